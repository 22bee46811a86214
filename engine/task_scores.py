"""Multiple-choice benchmarks with llama-perplexity's rules: HellaSwag, Winogrande and
ik_llama.cpp's binary multiple-choice files (ARC, MMLU, TruthfulQA...).

Every choice is the context followed by one ending, tokenized with BOS.  The endings share a
prefix of tokens; that prefix is decoded once, then each ending is decoded after it (the cache
cut back to the prefix in between), which gives the same log-probabilities as ik_llama.cpp's
multi-sequence batch up to float noise.

Task selection reproduces ik_llama.cpp built with GCC's libstdc++: std::mt19937 seeded with 1,
std::uniform_int_distribution<size_t> (Lemire's multiply-and-reject on the 32-bit draws) for
HellaSwag, and `int(float(1/2^32) * draw * n)` in float arithmetic for Winogrande and
multiple-choice.  An MSVC or libc++ build of the C++ tool picks other HellaSwag tasks.
"""
from __future__ import annotations

import random
import re
import struct
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from .perplexity import decode_batched, log_softmax_rows

# ---- ik_llama.cpp's random task selection -----------------------------------------------------


def mt19937(seed: int) -> random.Random:
    """A generator whose getrandbits(32) yields std::mt19937(seed)'s outputs: Python's core is
    the same MT19937, only its seeding differs, so the C++ seeding is done here."""
    mt = [seed & 0xFFFFFFFF]
    for i in range(1, 624):
        prev = mt[-1]
        mt.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    rng = random.Random()
    rng.setstate((3, tuple(mt) + (624,), None))
    return rng


def uniform_index(rng: random.Random, n: int) -> int:
    """libstdc++'s uniform_int_distribution<size_t>(0, n-1) on a 32-bit engine (1 <= n < 2^32)."""
    product = rng.getrandbits(32) * n
    low = product & 0xFFFFFFFF
    if low < n:
        threshold = (0x100000000 - n) % n
        while low < threshold:
            product = rng.getrandbits(32) * n
            low = product & 0xFFFFFFFF
    return product >> 32


_SCALE = np.float32(1.0) / (np.float32(1.0) + np.float32(0xFFFFFFFF))


def pick_tasks(n_total: int, n_pick: int) -> list[int]:
    """Winogrande / multiple-choice selection: indices drawn without replacement, each draw
    int(scale·rng()·remaining) in float32, the drawn slot refilled with the last one."""
    rng = mt19937(1)
    aux = list(range(n_total))
    out = []
    for _ in range(n_pick):
        j = int(_SCALE * np.float32(rng.getrandbits(32)) * np.float32(len(aux)))
        j = min(j, len(aux) - 1)    # a draw that rounds up to 2^32 would index past the end in C++
        out.append(aux[j])
        aux[j] = aux[-1]
        aux.pop()
    return out


# ---- task files -------------------------------------------------------------------------------


class TaskFileError(ValueError):
    pass


def _leading_int(s: str) -> int | None:
    """The integer std::stoi / `stream >> int` reads from the start of s (None: none there)."""
    m = re.match(r"\s*([+-]?\d+)", s)
    return int(m.group(1)) if m else None


def text_lines(text: str) -> list[str]:
    """Lines as std::getline splits them: no empty last line after a final newline."""
    if not text:
        return []
    lines = text.split("\n")
    return lines[:-1] if lines[-1] == "" else lines


@dataclass
class HellaswagTask:
    context: str
    gold: int
    endings: list[str]


def hellaswag_tasks(text: str, n_tasks: int) -> tuple[int, list[HellaswagTask]]:
    """(tasks in the file, the selected tasks in ik's random order).  Six lines per task:
    context, gold ending index, four endings.  ik always shuffles; n_tasks caps the count."""
    lines = text_lines(text)
    if len(lines) % 6:
        raise TaskFileError(f"number of lines in prompt not a multiple of 6 ({len(lines)} lines)")
    groups = [lines[i:i + 6] for i in range(0, len(lines), 6)]
    n_total = len(groups)
    rng = mt19937(1)
    picked = []
    for _ in range(min(n_tasks, n_total)):
        g = groups.pop(uniform_index(rng, len(groups)))
        gold = _leading_int(g[1])
        if gold is None:
            raise TaskFileError(f"bad gold ending index '{g[1]}' in task with context '{g[0][:60]}'")
        picked.append(HellaswagTask(g[0], gold, g[2:6]))
    return n_total, picked


@dataclass
class WinograndeTask:
    first: str
    second: str
    choices: tuple[str, str]
    answer: int


def _unquoted_commas(line: str, n: int) -> list[int]:
    pos, quoted = [], False
    for i, ch in enumerate(line):
        if ch == '"':
            quoted = not quoted
        elif ch == "," and not quoted:
            pos.append(i)
            if len(pos) == n:
                break
    return pos


def winogrande_tasks(text: str, warn: Callable[[str], None]) -> list[WinograndeTask]:
    """Rows `index,sentence,choice1,choice2,answer`, the blank in the sentence written `_`.
    Rows that do not parse are reported through warn and skipped, as ik does.  ik stops reading
    at a last line with no newline after it; -f drops the file's final newline, so a file's last
    row is never used there, nor here (parity of task counts and of the random selection)."""
    out = []
    lines = text.split("\n")[:-1]
    for line in lines:
        c = _unquoted_commas(line, 4)
        if len(c) != 4:
            warn(f"load_winogrande_from_csv: failed to find comma separators in <{line}>")
            continue
        if c[0] + 1 < len(line) and line[c[0] + 1] == '"':
            sentence = line[c[0] + 2:c[1] - 1]
        else:
            sentence = line[c[0] + 1:c[1]]
        where = sentence.find("_")
        if where < 0:
            warn(f"load_winogrande_from_csv: no _ in <{sentence}>")
            continue
        answer = line[c[3] + 1:]
        a = _leading_int(answer)
        if a not in (1, 2):
            warn(f"load_winogrande_from_csv: failed to parse answer <{answer}>")
            continue
        out.append(WinograndeTask(sentence[:where], sentence[where + 1:],
                                  (line[c[1] + 1:c[2]], line[c[2] + 1:c[3]]), a))
    return out


@dataclass
class ChoiceTask:
    question: str
    answers: list[str]
    labels: list[int]


class _Reader:
    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data, self.pos = data, pos

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise TaskFileError("truncated")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def string(self) -> str:
        return self.take(self.u32()).decode("utf-8", errors="replace")

    def answers(self) -> tuple[list[str], list[int]]:
        n = self.u32()
        if n > 100:     # ik's cap on the answers of one task
            raise TaskFileError(f"{n} answers")
        answers = [self.string() for _ in range(n)]
        return answers, list(struct.unpack(f"<{n}i", self.take(4 * n)))

    def task(self) -> ChoiceTask:
        question = self.string()
        answers, labels = self.answers()
        self.answers()          # the multiple-correct-answers set: read past, not scored (as ik)
        return ChoiceTask(question, answers, labels)


def choice_task_count(data: bytes) -> int:
    """Header of the binary file: uint32 task count, uint32 byte offset of each task, tasks."""
    if len(data) < 4 or struct.unpack_from("<I", data)[0] == 0:
        raise TaskFileError("no tasks")
    return struct.unpack_from("<I", data)[0]


def choice_tasks(data: bytes, n_select: int) -> list[ChoiceTask]:
    """Tasks of ik's binary multiple-choice file: all of them in file order (n_select 0 or at
    least the count), or n_select drawn at random and read at their stored offsets."""
    n = choice_task_count(data)
    r = _Reader(data, 4)
    try:
        pos = struct.unpack(f"<{n}I", r.take(4 * n))
    except TaskFileError:
        raise TaskFileError("failed to read task positions from prompt") from None
    if n_select == 0 or n_select >= n:
        tasks = []
        for i in range(n):
            try:
                tasks.append(r.task())
            except TaskFileError:
                raise TaskFileError(f"failed to read task {i + 1} of {n}") from None
        return tasks
    tasks = []
    for idx in pick_tasks(n, n_select):
        try:
            tasks.append(_Reader(data, pos[idx]).task())
        except TaskFileError:
            raise TaskFileError(f"failed to read task {idx} at position {pos[idx]}") from None
    return tasks


def check_choice_task(t: ChoiceTask) -> None:
    if not t.question or not t.answers:
        raise TaskFileError("found bad task with empty question and/or answers")
    if any(not a for a in t.answers):
        raise TaskFileError("found empty answer")
    if len(t.labels) != len(t.answers):
        raise TaskFileError("labels do not match the answers")


# ---- scoring ----------------------------------------------------------------------------------


def common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    """Leading tokens shared by all sequences."""
    n = 0
    for col in zip(*seqs):
        if any(t != col[0] for t in col[1:]):
            break
        n += 1
    return n


def required_tokens(seqs: Sequence[Sequence[int]]) -> int:
    """KV cells ik's batch takes for one task: the shared prefix once, every tail once."""
    cp = common_prefix(seqs)
    return cp + sum(len(s) - cp for s in seqs)


def shared_prefix_logits(ctx, seqs: Sequence[np.ndarray], n_shared: int, logits_from: int,
                         n_batch: int) -> Iterator[np.ndarray]:
    """For each sequence, the logits of its positions logits_from..len-1.  The first n_shared
    tokens (the same in all) are decoded once from an empty cache; each tail after them."""
    ctx.clear()
    head = decode_batched(ctx, seqs[0][:n_shared], n_batch, min(logits_from, n_shared))
    for seq in seqs:
        ctx.seq_rm(n_shared)
        tail = decode_batched(ctx, seq[n_shared:], n_batch, max(logits_from - n_shared, 0))
        yield np.concatenate([head, tail]) if len(head) else tail


def token_logprobs(rows: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log p(targets[i]) under logits rows[i] (float64)."""
    return log_softmax_rows(rows)[np.arange(len(targets)), targets]


def _as_arrays(seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
    return [np.asarray(s, dtype=np.int32) for s in seqs]


def ending_scores(ctx, seqs: Sequence[Sequence[int]], n_batch: int) -> np.ndarray:
    """HellaSwag's acc_norm score of each choice (and the multiple-choice one): the mean
    log-probability of the tokens after the prefix the choices share.

    ik leaves two cases undefined that are made explicit here: no shared token at all (no BOS)
    starts the scored tokens at the second one, and a choice that is all shared prefix moves the
    start back by one token so that every choice scores at least one token."""
    seqs = _as_arrays(seqs)
    min_len = min(len(s) for s in seqs)
    if min_len < 2:
        raise ValueError("a choice tokenizes to fewer than 2 tokens")
    cp = common_prefix(seqs)
    first = max(min(cp, min_len - 1), 1)
    scores = [token_logprobs(rows[:-1], seq[first:]).mean()
              for seq, rows in zip(seqs, shared_prefix_logits(ctx, seqs, min(cp, first), first - 1, n_batch))]
    return np.array(scores)


WINOGRANDE_MIN_TRAILING = 3     # ik: tails longer than this are scored after the choice word only


def winogrande_scores(ctx, seqs: Sequence[Sequence[int]], n_base: Sequence[int], n_batch: int) -> tuple[float, float]:
    """The two choices' scores as ik computes them: mean log-probability of the sentence tokens
    after the choice word (after the shared prefix when a tail is short), leaving out the last
    token when more than one is scored.  n_base: token counts of sentence-start + choice.

    Kept for parity, ik's quirk: when the tails are short, the second choice's first scored
    token is scored with the logits after the *first* choice's last token."""
    seqs = _as_arrays(seqs)
    cp = common_prefix(seqs)
    skip_choice = all(len(s) - cp > WINOGRANDE_MIN_TRAILING for s in seqs)
    base = [max(b if skip_choice else cp, 1) for b in n_base]
    lo = min(base) - 1
    scores, end_of_first = [], None
    for s, (seq, rows) in enumerate(zip(seqs, shared_prefix_logits(ctx, seqs, cp, lo, n_batch))):
        stop = len(seq) - (1 if len(seq) - base[s] > 1 else 0)     # tokens base..stop-1 are scored
        used = rows[base[s] - 1 - lo: stop - 1 - lo]
        if s == 1 and not skip_choice and len(used):
            used = np.concatenate([end_of_first, used[1:]])
        lp = token_logprobs(used, seq[base[s]:stop])
        scores.append(float(lp.sum() / len(lp)) if len(lp) else float("nan"))
        end_of_first = rows[-1:]
    return scores[0], scores[1]


def accuracy(n_right: int, n_done: int, n_tasks: int | None = None) -> tuple[float, float]:
    """100·p and 100·sqrt(p(1-p)/(n-1)) for p = n_right/n_done and n = n_tasks (default n_done),
    in float32 as ik computes them (n = 1 gives NaN or inf there and here)."""
    f = np.float32
    n = n_done if n_tasks is None else n_tasks
    with np.errstate(divide="ignore", invalid="ignore"):
        p = f(n_right) / f(n_done)
        sigma = np.sqrt(p * (f(1) - p) / f(n - 1))
    return float(f(100) * p), float(f(100) * sigma)
