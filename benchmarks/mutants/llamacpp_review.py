"""Issue 41's mutants: each a one-line break of a rule that tests/test_llamacpp_review.py guards. Applies one at a
time to src/, runs its test, restores the file; prints each mutant with pytest's exit code (1: the test caught it).

    .venv/bin/python benchmarks/mutants/llamacpp_review.py [NAME ...]
"""
import sys

from _apply import run  # benchmarks/mutants/ is on sys.path when this script runs
M = [
 ("tok-no-check", "src/epikv/llamacpp/model.py", "        self._model.ptr  # raises once the model is closed: the vocab pointer is freed with it\n", "", "test_tokenizer_outlives"),
 ("kv-old-formula", "src/epikv/llamacpp/model.py", '    k = (_ints(meta("attention.key_length")) or [default])[0]', '    k = default', "test_kv_bytes_per_cell"),
 ("run-one-short", "src/epikv/llamacpp/sequence.py", "runs.append((int(pos[start]), int(pos[i]) + 1))", "runs.append((int(pos[start]), int(pos[i]) + (1 if start == i else 0)))", "test_runs_of_several or test_mirror_check"),
 ("no-count-check", "src/epikv/llamacpp/sequence.py", "        if n is not None and n != pos.numel():", "        if False:", "test_mirror_check"),
 ("cb-no-catch", "src/epikv/llamacpp/capture.py", "            except BaseException as e:  # KeyboardInterrupt included: raised again by rows()", "            except ZeroDivisionError as e:", "test_an_exception_in_the_python"),
 ("no-probe", "src/epikv/llamacpp/engine.py", "        cells = probe_context(gm, ctx, cap)", "        cells = None", "test_a_graph_without"),
 ("req-err-fatal", "src/epikv/serving/llamacpp.py", "            except Exception as e:\n                if not isinstance(e, EpiKVError):", "            except EpiKVError as e:\n                if not isinstance(e, EpiKVError):", "test_a_request_that_fails"),
 ("piece-neg", "src/epikv/llamacpp/model.py", "        if token < 0 or token >= self.n_vocab:\n            return \"\"\n", "", "test_negative_token"),
 ("release-as-cancel", "src/epikv/serving/llamacpp.py", '        self._inbox.put(("release" if completed else "cancel", rid))', '        self._inbox.put(("cancel", rid))', "test_over_limit_and_stop"),
 ("no-submit-guard", "src/epikv/serving/llamacpp.py", "        if why:  # refused here, not queued", "        if False:  # refused here, not queued", "test_a_full_request_beyond"),
 ("drop-no-rm", "src/epikv/llamacpp/sequence.py", "        self._ll.llama_memory_seq_rm(self.mem, self.seq, -1, -1)\n        self.token_data, self._rows", "        self.token_data, self._rows", "test_a_request_that_fails or test_a_cancelled"),
]
T = "tests/test_llamacpp_review.py"
run([(name, f, a, b, T, k) for name, f, a, b, k in M], sys.argv[1:])
