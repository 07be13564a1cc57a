"""Band A (positive rho) and band B (negative rho) from a profile, written as a band file the policies read.

Rule: A = the layer of highest rho and B = the layer of lowest rho (by the chosen statistic); each band is the
contiguous run of layers around its peak whose rho keeps the peak's sign and at least `frac` of its magnitude.
A band is "supported" when every layer in it has a bootstrap interval that excludes 0 on the right side.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import EpiKVError

STATS = ("trace_mean", "pooled", "partial_position")


def _run(rho: list[float], peak: int, frac: float) -> list[int]:
    sign, thr = (1 if rho[peak] > 0 else -1), abs(rho[peak]) * frac
    ok = lambda l: rho[l] is not None and rho[l] * sign > 0 and abs(rho[l]) >= thr  # noqa: E731
    lo = hi = peak
    while lo - 1 >= 0 and ok(lo - 1):
        lo -= 1
    while hi + 1 < len(rho) and ok(hi + 1):
        hi += 1
    return list(range(lo, hi + 1))


def choose_bands(profile: dict, stat: str = "trace_mean", frac: float = 0.5) -> dict:
    """Band file content from a profile.json dict."""
    if stat not in STATS:
        raise EpiKVError(f"unknown statistic {stat!r}; choose one of {', '.join(STATS)}")
    if not 0 < frac <= 1:
        raise EpiKVError(f"--frac must be in (0, 1], got {frac}")
    try:
        layers = profile["layers"]
        rho = [row[stat] for row in layers]
        ci = [row[stat + "_ci"] for row in layers]
    except (KeyError, TypeError):
        raise EpiKVError("not a profile written by `epikv anatomy profile` (no per-layer rho)") from None
    finite = [i for i, r in enumerate(rho) if r is not None]
    if len(finite) < 2:
        raise EpiKVError("the profile has fewer than two layers with a finite rho: labels may all be equal")
    a = max(finite, key=lambda i: rho[i])
    b = min(finite, key=lambda i: rho[i])
    if not rho[a] > 0 or not rho[b] < 0:
        raise EpiKVError(f"no two-band structure to calibrate: highest rho {rho[a]:.3f}, lowest {rho[b]:.3f} "
                         "(need one positive and one negative layer)")
    band_a, band_b = _run(rho, a, frac), _run(rho, b, frac)
    sup = lambda band, s: all(ci[l][0] is not None and (ci[l][0] > 0 if s > 0 else ci[l][1] < 0) for l in band)  # noqa: E731
    return {
        "layers": [a, b], "band_a": band_a, "band_b": band_b,
        "rho": {"statistic": stat, "layer_a": rho[a], "layer_b": rho[b],
                "ci_a": ci[a], "ci_b": ci[b], "band_a": [rho[l] for l in band_a], "band_b": [rho[l] for l in band_b]},
        "supported": {"band_a": sup(band_a, 1), "band_b": sup(band_b, -1)},
        "rule": f"peak layers by {stat} rho; bands = contiguous run with the peak's sign and >= {frac} of its size",
        "model": profile.get("model"), "n_layers": len(rho), "n_traces": profile.get("n_traces"),
        "label": profile.get("label"),
    }


def write_bands(profile_dir: str, out: str, stat: str = "trace_mean", frac: float = 0.5) -> dict:
    path = Path(profile_dir)
    path = path / "profile.json" if path.is_dir() else path
    try:
        profile = json.loads(path.read_text())
    except FileNotFoundError:
        raise EpiKVError(f"{path} does not exist (run `epikv anatomy profile` first)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise EpiKVError(f"cannot read profile {path}: {e}") from None
    bands = choose_bands(profile, stat, frac)
    bands["profile"] = str(path)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(bands, indent=1) + "\n")
    return bands
