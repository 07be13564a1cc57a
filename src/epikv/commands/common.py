"""Argument types and option groups shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from ..errors import EpiKVError
from ..models import DEFAULT_MODEL
from ..policies import FALLBACK_POLICY, policy_names


def _number(cast, ok, expected: str):
    """An argparse type: `cast` the text and check it with `ok`, else "expected <expected>, got '<text>'"."""

    def parse(text: str):
        try:
            v = cast(text)
        except ValueError:
            v = None
        if v is None or not ok(v):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return v

    parse.__name__ = cast.__name__  # argparse names the type in its own messages
    return parse


positive_int = _number(int, lambda v: v >= 1, "a positive integer")
nonneg_int = _number(int, lambda v: v >= 0, "an integer >= 0")
nonneg_float = _number(float, lambda v: v >= 0, "a number >= 0")  # also refuses nan
top_p_float = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def read_text(path: str, what: str = "") -> str:
    """A text file's contents, or a one-line error naming it."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise EpiKVError(f"cannot read {what + ' ' if what else ''}{path}: {why}") from None


def _first_existing(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable(folder: Path, file: Path | None = None) -> None:
    """Refuse, before any work, an output location this process cannot write: a temporary file is made and removed
    in `folder` or, when it does not exist yet, in its nearest existing parent (where it would be created); an
    existing `file` is opened for appending (nothing written). Raises ArgumentTypeError "cannot write in DIR: why"."""
    base = _first_existing(folder)
    try:
        fd, name = tempfile.mkstemp(prefix=".epikv-write-check-", dir=base)
        os.close(fd)
        os.unlink(name)
        if file is not None and file.exists():
            open(file, "ab").close()
    except OSError as e:
        where = file if file is not None and file.exists() and base == file.parent else base
        raise argparse.ArgumentTypeError(f"cannot write in {where}: {e.strerror or e}") from None


def out_dir(text: str) -> str:
    """An argparse type for an output folder: refused when it (or a folder above it) exists as a file, or when it
    (or the folder it would be created in) is not writable."""
    p = Path(text)
    if p.exists() and not p.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
    if not _first_existing(p).is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {_first_existing(p)} is a file, not a folder")
    check_writable(p)
    return text


def out_file(text: str) -> str:
    """An argparse type for an output file: refused when it is a folder, a folder above it is a file, or it (or the
    folder it would be written in) is not writable. Missing folders above it are created by the writer."""
    p = Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; expected a file to write")
    if not _first_existing(p.parent).is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {_first_existing(p.parent)} is a file, not a folder")
    check_writable(p.parent, p)
    return text


class _Given(argparse.Action):
    """Store the value and remember that the option was given on the command line (not left at its default)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = set(getattr(namespace, "given", None) or ()) | {self.dest}


def warn(args: argparse.Namespace, message: str) -> None:
    """A one-line warning on stderr; the command goes on."""
    print(f"epikv {getattr(args, 'command', '')}: warning: {message}", file=sys.stderr)


def int_list(text: str) -> list[int]:
    """'512,1024' -> [512, 1024] (positive integers)."""
    return [positive_int(x.strip()) for x in text.split(",") if x.strip()] or _bad(text)


def name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()] or _bad(text)


def _bad(text):
    raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets: 'a,b[x=1, y=[2, 3]]' -> ['a', 'b[x=1, y=[2, 3]]']."""
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += (ch in "[(") - (ch in "])")
        if depth < 0:
            raise argparse.ArgumentTypeError(f"unbalanced brackets in {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise argparse.ArgumentTypeError(f"unbalanced brackets in {text!r}")
    return [x.strip() for x in parts + ["".join(cur)]]


def policy_variant(spec: str) -> tuple[str, dict]:
    """'epikv[reserve=16, layers=[6, 20]]' -> ("epikv", {"reserve": 16, "layers": (6, 20)}); a plain name -> (name,
    {}). The bracket holds SETTING=VALUE pairs read as `--set` reads them; it is the row label the reports print, so
    a row can be run again by its label."""
    name, bracket, rest = spec.strip().partition("[")
    name = name.strip()
    if not bracket:
        return name, {}
    if not rest.endswith("]") or not rest[:-1].strip():
        raise argparse.ArgumentTypeError(f"expected POLICY[SETTING=VALUE, ...], got {spec!r}")
    settings = {}
    for item in _split_top(rest[:-1]):
        _, key, value = policy_setting(f"{name}.{item}", tau=True)
        if key in settings:
            raise argparse.ArgumentTypeError(f"{spec!r} sets {key} twice")
        settings[key] = value
    return name, settings


def policy_list(text: str) -> list[str]:
    """'full,epikv,epikv[reserve=16]' -> the policy specs (commas inside brackets belong to a variant), each checked
    by `policy_variant`."""
    specs = [x for x in _split_top(text) if x] or _bad(text)
    for spec in specs:
        policy_variant(spec)
    return specs


def policy_setting(text: str, tau: bool = False) -> tuple[str, str, object]:
    """'lagkv.lag=128' -> ("lagkv", "lag", 128): any dataclass field of a registered policy, the value read as JSON
    (lists become tuples) and checked against the type of the field's default. tau (the run's --tau, shared by all)
    only where `tau` is set: a retention variant's own schedule, `random[tau=16]`."""
    import dataclasses

    from ..policies import policy_class

    head, eq, raw = text.partition("=")
    name, dot, key = head.strip().rpartition(".")
    if not (eq and dot and name and key):
        raise argparse.ArgumentTypeError(f"expected POLICY.SETTING=VALUE, got {text!r}")
    try:
        cls = policy_class(name)
    except EpiKVError as e:
        raise argparse.ArgumentTypeError(f"{e} in {text!r}") from None
    fields = {f.name: f for f in dataclasses.fields(cls) if tau or f.name != "tau"}
    if key == "tau" and not tau:
        raise argparse.ArgumentTypeError("the eviction interval is --tau, not --set")
    if key not in fields:
        raise argparse.ArgumentTypeError(f"{name} has no setting {key!r}; its settings: {', '.join(fields)}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw.strip()
    value = tuple(value) if isinstance(value, list) else value
    default = fields[key].default
    # the default's exact type (bool is not an int here), an int where a float is expected; a None default: the
    # plain types its annotation names (`int | None` -> int), anything when it names none
    wants = [type(default)] if default is not None else _annotated_types(cls, key)
    ok = lambda want: type(value) is want or (want, type(value)) == (float, int)  # noqa: E731
    if value is not None and wants and not any(ok(w) for w in wants):
        raise argparse.ArgumentTypeError(f"{name}.{key} expects {' or '.join(w.__name__ for w in wants)}, "
                                         f"got {raw!r}")
    return name, key, value


def _annotated_types(cls, key: str) -> list[type]:
    """Plain types (int, float, bool, str, tuple) named by a dataclass field's annotation, None excluded."""
    import typing

    try:
        hint = typing.get_type_hints(cls)[key]
    except Exception:  # an annotation this Python cannot evaluate: no check
        return []
    out = []
    for t in typing.get_args(hint) or (hint,):
        t = typing.get_origin(t) or t
        if t in (int, float, bool, str, tuple):
            out.append(t)
    return out


def layer_list(text: str) -> tuple[int, ...]:
    """'10,21' -> (10, 21)."""
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer indices like 10,21, got {text!r}") from None
    if any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"layer indices must be >= 0, got {text!r}")
    return vals


def band_list(text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """'7-13,18-25' -> ((7..13), (18..25))."""
    try:
        bands = []
        for part in text.split(","):
            lo, hi = (int(x) for x in part.split("-"))
            if lo < 0 or hi < lo:
                raise ValueError
            bands.append(tuple(range(lo, hi + 1)))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two bands like 7-13,18-25, got {text!r}") from None
    if len(bands) != 2:
        raise argparse.ArgumentTypeError(f"expected exactly two bands (A,B), got {text!r}")
    return bands[0], bands[1]


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="smollm2 (embedded, default), random:<preset>[:seed], a hub id or a local folder")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cpu)")
    g.add_argument("--device-map", default=None, help="'auto' spreads the model over all GPUs")
    g.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU, bf16 on GPU)")
    g.add_argument("--attn", default=None, help="attention kernel: sdpa (default), flash_attention_2, eager")


def default_policy_help(by_engine: bool = False) -> str:
    """The --policy default as the help states it: DEFAULT_POLICY, and each engine's own where one refuses it."""
    from ..policies import DEFAULT_POLICY, ENTRY_DEFAULTS, FALLBACK_POLICY

    own = [f"--engine {key.split('-', 1)[1]}, which refuses it: {name}" for key, name in ENTRY_DEFAULTS.items()
           if by_engine and key.startswith("serve-")]
    return (f"default {DEFAULT_POLICY}: the least answer-likelihood lost at K = 1024 among the per-token policies on "
            f"whole reasoning traces so far (docs/choosing.md, with K = 512's order beside it); "
            f"{FALLBACK_POLICY} where no weights fit the model"
            + "".join(f"; on {o}" for o in own))


def add_policy_args(p: argparse.ArgumentParser, multi: bool = False, by_engine: bool = False, also: str = "",
                    own_default: bool = False) -> None:
    """The eviction options. by_engine: the default policy depends on --engine (left None here, resolved by the
    command with `epikv.policies.default_policy`); also: a policy the default list starts with (a benchmark's
    reference); own_default: the command sets its own default list (a benchmark's comparison set)."""
    from ..policies import DEFAULT_POLICY

    g = p.add_argument_group("eviction")
    if multi:
        said = "" if own_default else f" ({also + ' and ' if also else ''}{default_policy_help(by_engine)})"
        g.add_argument("--policies", type=policy_list, default=None if by_engine or own_default else [str(DEFAULT_POLICY)],
                       help=f"comma-separated policy names{said}")
        g.add_argument("--budgets", type=int_list, default=[1024], action=_Given,
                       help="comma-separated cache budgets K (each peaks at K + tau tokens: K + tau - 1 between "
                            "evictions and the step's own)")
    else:
        g.add_argument("--policy", default=None if by_engine else DEFAULT_POLICY, action=_Given,
                       help=f"one of: {', '.join(policy_names())}"
                            + ("" if own_default else f" ({default_policy_help(by_engine)})"))
        g.add_argument("--budget", type=positive_int, default=1024, action=_Given,
                       help="cache budget K (tokens, prompt included, after an eviction; the cache peaks at K + tau: "
                            "K + tau - 1 between evictions and the step's own; ignored by full, with a warning)")
    g.add_argument("--tau", type=positive_int, default=None,
                   help="eviction interval in steps (default: the policy's own, 128 for epikv-seg and epikv-seg-q, 16 "
                        "for the epikv-learned family, 1 for the rest)")
    g.add_argument("--recent", type=nonneg_int, default=None, help="protected recent tokens (default min(128, K/4))")
    g.add_argument("--no-protect-prompt", action="store_true", help="protect only the first --n-sink tokens")
    g.add_argument("--n-sink", type=nonneg_int, default=None,
                   help="sink tokens protected without prompt protection (only with --no-protect-prompt)")
    g.add_argument("--layers", type=layer_list, default=None,
                   help="EPIKV blocks A,B (default: the authors' layers for their models, Qwen2-7B 20,24 and "
                        "Llama-8B 10,21; elsewhere 10,21 of 32 scaled by depth; the EPIKV family but epikv-band)")
    g.add_argument("--bands", type=band_list, default=None, help="band-adaptive bands, e.g. 7-13,18-25 (epikv-band)")
    g.add_argument("--bands-file", default=None,
                   help="a band file written by `epikv anatomy bands` (its layers: epikv, epikv-raw, epikv-a; "
                        "its bands: epikv-band)")
    g.add_argument("--weights", default=None, metavar="FILE",
                   help="learned weights (a file from `epikv calibrate`) for the epikv-learned policies, still checked "
                        "against the model's fingerprint; default: the file fitted on this model, from the shipped "
                        "ones and the cache folder $EPIKV_WEIGHTS_DIR (~/.cache/epikv/weights)")
    g.add_argument("--set", type=policy_setting, action="append", default=[], metavar="POLICY.SETTING=VALUE",
                   help="any other policy setting, e.g. lagkv.lag=128 (repeatable; see `epikv policies --json`)")


# What a model with sliding-window layers (Gemma-3, GPT-OSS, Ministral) runs when no policy is named and the default
# cannot run there: the default's own fallback (epikv.policies.FALLBACK_POLICY), which runs on every model.
HYBRID_FALLBACK = FALLBACK_POLICY


def hybrid_policy(args: argparse.Namespace, model) -> None:
    """On a model mixing sliding-window and full-attention layers, a policy the cache refuses there: the default
    (--policy not given) falls back to HYBRID_FALLBACK with one warning line; a policy the user named is refused in
    one line that lists the policies that run on this model. Sets args.policy; a model without sliding-window layers
    (or with nothing but them: the cache's own refusal) is left to the cache."""
    import re

    from ..hooks import _check_hybrid_policy, attention_layout, decoder_layers
    from ..policies import REGISTRY, get_policy

    n = len(decoder_layers(model))
    sliding, _ = attention_layout(model, n)
    if not sliding or len(sliding) == n:
        return

    def refusal(pol) -> str | None:
        try:
            _check_hybrid_policy(pol, pol.observes(n), n)
        except EpiKVError as e:
            return str(e)
        return None

    why = refusal(get_policy(args.policy))
    if why is None:
        return
    if "policy" in (getattr(args, "given", None) or set()):
        from ..cache import EpiKVCache

        def builds(name: str) -> bool:  # what the cache itself accepts on this model (learned weights that fit ...)
            try:
                EpiKVCache(model, name, budget=max(64, args.budget or 0))
            except EpiKVError:
                return False
            return True

        runs = [name for name, cls in REGISTRY.items() if refusal(cls()) is None and builds(name)]
        raise EpiKVError(f"{why}; on this model run one of: {', '.join(runs)}")
    m = re.match(rf"policy {re.escape(args.policy)} (.*?), which is not supported", why)
    warn(args, f"the default policy {args.policy} does not run on a model with sliding-window layers"
               f"{' (it ' + m.group(1) + ')' if m else ''}: running {HYBRID_FALLBACK} instead, the best measured "
               "policy that does (docs/choosing.md); --policy chooses another")
    args.policy = HYBRID_FALLBACK


def default_for_model(args: argparse.Namespace, model) -> None:
    """No --policy given and the default reads learned weights that no file fits for this transformers model: the
    fallback (epikv.policies.FALLBACK_POLICY) with one warning line, set in args.policy before anything is built, so
    every label and record names the policy that runs. A named policy is left to the engine's own refusal."""
    from ..cache import _check_learned, decoder_layers
    from ..fingerprint import model_fingerprint
    from ..policies import for_model, get_policy
    from ..signals import model_depth

    if "policy" in (getattr(args, "given", None) or set()):
        return
    pol = get_policy(args.policy)
    if getattr(pol, "check_model", None) is None:
        return
    layers = decoder_layers(model)
    fp, depth = model_fingerprint(model, layers), model_depth(model.config, len(layers))
    args.policy = str(for_model(pol, lambda p: _check_learned(p, fp, depth)).name)


def policy_settings(args: argparse.Namespace, policy_name: str) -> dict:
    """Settings from the command line that apply to `policy_name` (unset ones are left to the policy)."""
    from ..policies import policy_class

    cls = policy_class(policy_name)
    import dataclasses

    fields = {f.name for f in dataclasses.fields(cls)}
    s: dict = {"recent": args.recent, "n_sink": args.n_sink}
    if args.no_protect_prompt:
        s["protect_prompt"] = False
    layers, bands = args.layers, args.bands
    if getattr(args, "bands_file", None):
        layers_f, bands_f = read_bands_file(args.bands_file)
        layers, bands = layers or layers_f, bands or bands_f
    if layers is not None and "layers" in fields:
        s["layers"] = layers[: 1] if policy_name == "epikv-a" else layers
    if bands is not None and "bands" in fields:
        s["bands"] = bands
    if getattr(args, "weights", None) is not None and "weights" in fields:
        s["weights"] = args.weights
    s.update({key: value for name, key, value in getattr(args, "set", None) or [] if name == policy_name})
    n_blocks = 1 if policy_name == "epikv-a" else 2
    if s.get("layers") is not None and "layers" in fields and len(s["layers"]) != n_blocks:
        raise EpiKVError(f"{policy_name} takes {n_blocks} layer block{'s' if n_blocks > 1 else ''} "
                         f"({'A' if n_blocks == 1 else 'A,B'}), got {len(s['layers'])}")
    return {k: v for k, v in s.items() if v is not None and k in fields}


def settings_by_policy(args: argparse.Namespace, specs: list[str], variants: bool = False) -> dict[str, dict]:
    """{spec: settings} for the policies a command runs: policy_settings(args, name), and with variants=True a spec
    may be a variant `name[SETTING=VALUE, ...]` whose settings override those (commands that run variants: the
    retention benchmark; the others refuse them). Options none of these policies would read are refused (a --set
    naming another policy, --layers / --bands / --bands-file without a policy that has them, --n-sink while the
    prompt is protected); --budget with only non-evicting policies is a warning."""
    import dataclasses

    from ..policies import REGISTRY

    try:
        parsed = {spec: policy_variant(spec) for spec in specs}
    except argparse.ArgumentTypeError as e:
        raise EpiKVError(str(e)) from None
    odd = [spec for spec, (_, over) in parsed.items() if over]
    if odd and not variants:
        name, over = parsed[odd[0]]
        sets = " ".join(f"--tau {v}" if k == "tau" else f"--set {name}.{k}={json.dumps(v)}" for k, v in over.items())
        raise EpiKVError(f"policy variants like {odd[0]} are run by `epikv retention`; here use {sets}")
    names = list(dict.fromkeys(name for name, _ in parsed.values()))
    stray = sorted({name for name, _, _ in getattr(args, "set", None) or [] if name not in names})
    if stray:
        raise EpiKVError(f"--set names {', '.join(stray)}, which this command does not run")
    out = {name: policy_settings(args, name) for name in names}
    fields = {n: {f.name: f.default for f in dataclasses.fields(REGISTRY[n])} for n in names}
    running = ", ".join(names)
    has = lambda key: [n for n in names if key in fields[n]]  # noqa: E731
    if getattr(args, "layers", None) is not None and not has("layers"):
        raise EpiKVError(f"--layers is read by epikv, epikv-raw and epikv-a, not by {running}")
    if getattr(args, "weights", None) is not None:
        if not has("weights"):
            raise EpiKVError(f"--weights is read by the epikv-learned policies, not by {running}")
        from ..policies.learned import load_weights

        load_weights(args.weights)  # a missing or foreign file: one line, before the model loads
    if getattr(args, "bands", None) is not None and not has("bands"):
        raise EpiKVError(f"--bands is read by epikv-band only, not by {running} (for epikv: --layers)")
    if getattr(args, "bands_file", None):
        layers_f, bands_f = read_bands_file(args.bands_file)
        if not (layers_f and has("layers")) and not (bands_f and has("bands")):
            what = " and ".join(x for x, y in (("layers", layers_f), ("bands", bands_f)) if y)
            readers = ", ".join(x for x, y in (("epikv, epikv-raw, epikv-a", layers_f), ("epikv-band", bands_f)) if y)
            raise EpiKVError(f"--bands-file: its {what} are read by {readers}, not by {running}")
    if getattr(args, "n_sink", None) is not None and not any(
            not out[n].get("protect_prompt", fields[n]["protect_prompt"]) for n in names):
        raise EpiKVError("--n-sink only applies with --no-protect-prompt (otherwise the whole prompt is protected)")
    given = getattr(args, "given", None) or set()
    if given & {"budget", "budgets"} and not any(REGISTRY[n].evicts for n in names):
        warn(args, f"{running} never evict{'s' if len(names) == 1 else ''}: "
                   f"--{'budget' if 'budget' in given else 'budgets'} is ignored")
    return {spec: {**out[name], **over} for spec, (name, over) in parsed.items()}


def read_bands_file(path: str) -> tuple[tuple[int, ...] | None, tuple | None]:
    """A band file: {"layers": [A, B], "band_a": [...], "band_b": [...]} (written by `epikv anatomy bands`)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EpiKVError(f"bands file {path} does not exist") from None
    except UnicodeDecodeError:
        raise EpiKVError(f"cannot read bands file {path}: not UTF-8 text (expected the JSON written by "
                         "`epikv anatomy bands`)") from None
    except (OSError, json.JSONDecodeError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise EpiKVError(f"cannot read bands file {path}: {why}") from None
    try:
        layers = tuple(int(x) for x in data["layers"]) if data.get("layers") else None
        bands = (tuple(int(x) for x in data["band_a"]), tuple(int(x) for x in data["band_b"])) \
            if data.get("band_a") and data.get("band_b") else None
    except (TypeError, ValueError, AttributeError):
        raise EpiKVError(f"bands file {path} is malformed: expected layers, band_a, band_b lists of integers") from None
    if layers is None and bands is None:
        raise EpiKVError(f"bands file {path} has neither layers nor bands")
    return layers, bands


def load(args):
    from ..models import load_model

    return load_model(args.model, dtype=args.dtype, device=args.device, device_map=args.device_map,
                      attn_implementation=args.attn)
