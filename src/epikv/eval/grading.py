"""Answer extraction and the two graders: math-verify equivalence (integers for AIME/GSM8K) and the paper's strict
string matcher. Both verdicts go into every record so the two families of numbers can be compared."""

from __future__ import annotations

import re
import threading
from fractions import Fraction

_BOX = re.compile(r"\\(?:boxed|fbox)\s*")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox) in `text`, nested braces included; None if there is none.
    `\\boxed 5` (no braces) yields the following token."""
    starts = [m for m in _BOX.finditer(text or "")]
    for m in reversed(starts):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
            continue  # unbalanced (cut off by the token cap): try an earlier box
        tok = re.match(r"[^\s$]+", text[i:])
        if tok:
            return tok.group(0)
    return None


# ---- integers (AIME, GSM8K) -------------------------------------------------------------------------------------

def to_number(ans: str) -> Fraction | None:
    """'1,234', '$18', '18.00', '\\$5', '\\text{18 dollars}', '\\frac{3}{4}' -> an exact number, else None."""
    s = ans.strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:,|!|;|\s)", "", s)  # LaTeX spacing
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # thousands separators
    frac = re.fullmatch(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", s.strip())
    if frac and int(frac.group(2)):
        return Fraction(int(frac.group(1)), int(frac.group(2)))
    m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*(?:[a-zA-Z][a-zA-Z .]*)?\s*\.?", s)  # trailing unit words allowed
    return Fraction(m.group(1)) if m else None


# ---- math-verify ---------------------------------------------------------------------------------------------------

def math_verify_equal(pred: str, gold: str) -> bool:
    """Symbolic equivalence of two LaTeX answers with math-verify. Its timeouts use SIGALRM, which only works on the
    main thread, so they are switched off elsewhere (Ray actors, thread pools)."""
    from math_verify import parse, verify

    main = threading.current_thread() is threading.main_thread()
    t = 5 if main else None
    try:
        g = parse(f"${gold}$", parsing_timeout=t)
        p = parse(f"${pred}$", parsing_timeout=t)
        if not g or not p:
            return False
        return bool(verify(g, p, timeout_seconds=t))
    except Exception:  # math-verify raises on pathological input; that answer is simply not equivalent
        return False


# ---- the paper's strict matcher -----------------------------------------------------------------------------------

def _unwrap_text(s: str) -> str:
    prev = None
    while prev != s:
        prev = s
        s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    return s


def strict_normalize(s: str) -> str:
    s = s.strip()
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = _unwrap_text(s)
    s = re.sub(r"^\s*[a-zA-Z]\s*=\s*", "", s)  # drop "x="
    s = s.lower()
    return re.sub(r"\s+", "", s)


def _top_level_split(s: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def strict_equal(pred: str, gold: str) -> bool:
    """The paper's string matcher: normalised strings equal, comma lists compared order-insensitively, commas and
    spaces otherwise dropped. Misses equivalent forms on purpose (e.g. 11\\sqrt2 vs 11\\sqrt{2})."""
    p, g = strict_normalize(pred), strict_normalize(gold)
    if p == g:
        return True
    pp, gp = _top_level_split(p), _top_level_split(g)
    if len(pp) > 1 and len(pp) == len(gp):
        return sorted(x.replace(",", "") for x in pp) == sorted(x.replace(",", "") for x in gp)
    return p.replace(",", "") == g.replace(",", "")


# ---- one verdict for a record ------------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number of a text ('1,234.5' kept whole): the usual GSM8K fallback when there is no box."""
    nums = _NUMBER.findall(text or "")
    return nums[-1].rstrip(",.") if nums else None


def grade(output: str, gold: str, integer: bool = False) -> dict:
    """-> {"final_answer", "correct" (math-verify, or integer compare), "correct_strict", "correct_lenient"} for a
    whole output. `correct_lenient` is not a protocol grader: for integer answers it falls back to the last number
    when there is no box (small models rarely box), so weak models still give a signal."""
    ans = last_boxed(output)
    if ans is None:
        fallback = last_number(output) if integer else None
        a, b = (to_number(fallback), to_number(gold)) if fallback else (None, None)
        lenient = a is not None and a == b
        return {"final_answer": None, "correct": False, "correct_strict": False, "correct_lenient": lenient}
    if integer:
        a, b = to_number(ans), to_number(gold)
        ok = (a == b) if (a is not None and b is not None) else math_verify_equal(ans, gold)
    else:
        ok = strict_equal(ans, gold) or math_verify_equal(ans, gold)
    return {"final_answer": ans, "correct": bool(ok), "correct_strict": strict_equal(ans, gold),
            "correct_lenient": bool(ok)}
