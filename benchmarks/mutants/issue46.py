"""Issue 46's mutants: each a one-line break of a rule its tests guard (see benchmarks/mutants/_apply.py).

    .venv/bin/python benchmarks/mutants/issue46.py [NAME ...]
"""
import sys

from _apply import run  # benchmarks/mutants/ is on sys.path when this script runs

run([
 # Seg-Q's query layer recomputed from a count (the defect): the guard fails on the published qwen2 entry
 ("segq-layer-from-count", "src/epikv/policies/epikv_seg_q.py", '        qa = state["_qa"]',
  "        qa = self.query_layer(len(view.keys))", "tests/test_published_layers.py", "seg-q"),
 # Ctrl-C not held around the decode with the Python callback
 ("sigint-not-held", "src/epikv/llamacpp/capture.py",
  "    if not active or threading.current_thread() is not threading.main_thread():",
  "    if True:", "tests/test_llamacpp_interrupts.py", "sigint"),
 # attn_rows does not raise the error the callback kept
 ("attn-rows-drops-error", "src/epikv/llamacpp/capture.py", "        self._raise_error()\n        lo, hi",
  "        lo, hi", "tests/test_llamacpp_interrupts.py", "attn_rows"),
 # /stats reads the live sequences' mirrors from the scraping thread again
 ("stats-reads-sequences", "src/epikv/serving/llamacpp.py", "                 kv_mirror_bytes=self._mirror_bytes,",
  "                 kv_mirror_bytes=sum(r.seq.mirror_bytes() for r in list(self._running) if r.seq is not None),",
  "tests/test_llamacpp_streams.py", "stats_while"),
], sys.argv[1:])
