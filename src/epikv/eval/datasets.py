"""Benchmark problems: MATH-500, AIME 2024/2025, GSM8K as JSONL (fields id, problem, answer) from the copy shipped
with the package (default), from --data-dir or $EPIKV_DATA_DIR holding the same file names, or from the Hugging Face
hub as `hf:NAME`; or any JSONL file given by path."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..data import data_dir as default_data_dir, read_jsonl
from ..errors import EpiKVError


@dataclass(frozen=True)
class Named:
    file: str  # JSONL name in the data folder (the shipped one: epikv/datasets/)
    hub: str  # hub dataset id
    hub_config: str | None
    split: str
    integer: bool  # answers are integers: graded by integer compare
    max_new_tokens: dict  # per protocol


DATASETS: dict[str, Named] = {
    "math500": Named("math500.jsonl", "HuggingFaceH4/MATH-500", None, "test", False, {"paper": 8192, "r1": 32768}),
    "aime2024": Named("aime2024.jsonl", "Maxwell-Jia/AIME_2024", None, "train", True, {"paper": 16384, "r1": 32768}),
    "aime2025": Named("aime2025.jsonl", "MathArena/aime_2025", None, "train", True, {"paper": 16384, "r1": 32768}),
    "gsm8k": Named("gsm8k_test.jsonl", "openai/gsm8k", "main", "test", True, {"paper": 8192, "r1": 32768}),
}


@dataclass
class Dataset:
    name: str
    source: str  # where the rows came from
    rows: list[dict]  # each: id, problem, answer (strings)
    integer: bool

    def fingerprint(self) -> str:
        """Hash of ids and answers: two runs on different data never share an output directory."""
        h = hashlib.sha256()
        for r in self.rows:
            h.update(json.dumps([r["id"], r["answer"]]).encode())
        return h.hexdigest()[:16]


def load_dataset(spec: str, data_dir: str | None = None, limit: int | None = None) -> Dataset:
    """spec: a name in DATASETS, `hf:NAME` (that set from the hub), or a path to a JSONL file. Named sets are read
    from the data folder: the argument, else $EPIKV_DATA_DIR, else the copy shipped with the package."""
    if spec.startswith("hf:") and spec[3:] in DATASETS:
        spec, info = spec[3:], DATASETS[spec[3:]]
        rows, source, integer = _hub(spec, info), f"hf:{info.hub}", info.integer
    elif spec in DATASETS:
        info = DATASETS[spec]
        path = Path(data_dir or default_data_dir()) / info.file
        rows, source, integer = _local(path), str(path), info.integer
    elif spec.endswith(".jsonl") or Path(spec).exists() or "/" in spec:
        path = Path(spec)
        rows, source = _local(path), str(path)
        integer = all(re.fullmatch(r"-?\d+", str(r.get("answer_norm", r["answer"])).replace(",", "")) for r in rows)
        spec = path.stem
    else:
        raise EpiKVError(f"unknown dataset {spec!r}; known: {', '.join(DATASETS)} (hf:NAME: from the hub), or a path "
                         "to a .jsonl file")
    if not rows:
        raise EpiKVError(f"dataset {spec} ({source}) has no rows")
    rows = rows[:limit] if limit else rows
    return Dataset(spec, source, rows, integer)


def _local(path: Path) -> list[dict]:
    raw = read_jsonl(path, required=("id", "problem", "answer"))
    out, seen = [], set()
    for i, r in enumerate(raw, 1):
        rid = str(r["id"])
        if rid in seen:
            raise EpiKVError(f"{path}: duplicate id {rid!r} (row {i})")
        if not str(r["problem"]).strip() or str(r["answer"]).strip() == "":
            raise EpiKVError(f"{path}: row {i} (id {rid}) has an empty problem or answer")
        seen.add(rid)
        out.append({"id": rid, "problem": str(r["problem"]), "answer": str(r.get("answer_norm", r["answer"]))})
    return out


def _hub(name: str, info: Named) -> list[dict]:
    try:
        import datasets  # optional: only needed for hub downloads
    except ImportError:
        raise EpiKVError(f"loading {name} from the hub needs `pip install datasets`; or use --dataset {name} "
                         "(the copy shipped with epikv)") from None
    try:
        ds = datasets.load_dataset(info.hub, info.hub_config, split=info.split)
    except Exception as e:  # network, auth, offline mode
        raise EpiKVError(f"cannot load {info.hub} from the hub ({type(e).__name__}); "
                         f"--dataset {name} reads the copy shipped with epikv") from None
    rows = []
    for i, r in enumerate(ds):
        r = {k.lower(): v for k, v in r.items()}
        problem = r.get("problem") or r.get("question")
        answer = str(r.get("answer"))
        if name == "gsm8k":
            answer = answer.split("####")[-1].strip().replace(",", "")
        elif info.integer:
            answer = str(int(answer)) if answer.strip().lstrip("-").isdigit() else answer
        rid = str(r.get("unique_id") or r.get("id") or r.get("problem_idx") or f"{name}_{i:04d}")
        rows.append({"id": rid, "problem": problem, "answer": answer})
    return rows
