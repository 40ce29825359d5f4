"""Statistics the planner validation needs, in plain Python (no scipy): ranks with ties,
Pearson and Spearman correlation, non-negative least squares, the geometric mean, and the
Spearman correlation a perfect predictor reaches against noisy measurements."""

from __future__ import annotations

import itertools
import math
import random


def ranks(xs: list[float]) -> list[float]:
  """1-based ranks, ties sharing their average rank."""
  order = sorted(range(len(xs)), key=lambda i: xs[i])
  out = [0.0] * len(xs)
  i = 0
  while i < len(order):
    j = i
    while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
      j += 1
    for k in range(i, j + 1):
      out[order[k]] = (i + j) / 2 + 1
    i = j + 1
  return out


def pearson(xs: list[float], ys: list[float]) -> float:
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
  sxx = sum((x - mx) ** 2 for x in xs)
  syy = sum((y - my) ** 2 for y in ys)
  return sxy / math.sqrt(sxx * syy) if sxx and syy else float("nan")


def spearman(xs: list[float], ys: list[float]) -> float:
  return pearson(ranks(xs), ranks(ys))


def solve(a: list[list[float]], b: list[float]) -> list[float] | None:
  """Gaussian elimination with partial pivoting; None when singular."""
  n = len(b)
  m = [row[:] + [v] for row, v in zip(a, b)]
  for c in range(n):
    p = max(range(c, n), key=lambda r: abs(m[r][c]))
    if abs(m[p][c]) < 1e-300:
      return None
    m[c], m[p] = m[p], m[c]
    for r in range(n):
      if r != c:
        f = m[r][c] / m[c][c]
        m[r] = [x - f * y for x, y in zip(m[r], m[c])]
  return [m[i][n] / m[i][i] for i in range(n)]


def nnls(rows: list[list[float]], ys: list[float]) -> list[float]:
  """min |X w - y| with w >= 0, by trying every set of free coefficients (a handful here).

  Columns are scaled to unit norm first, so seconds-per-byte and seconds-per-collective
  coefficients are solved on the same footing.
  """
  k = len(rows[0])
  norms = [math.sqrt(sum(r[j] ** 2 for r in rows)) or 1.0 for j in range(k)]
  xs = [[r[j] / norms[j] for j in range(k)] for r in rows]
  best, best_err = [0.0] * k, sum(y * y for y in ys)
  for size in range(1, k + 1):
    for free in itertools.combinations(range(k), size):
      a = [[sum(x[i] * x[j] for x in xs) for j in free] for i in free]
      b = [sum(x[i] * y for x, y in zip(xs, ys)) for i in free]
      sol = solve(a, b)
      if sol is None or min(sol) < 0:
        continue
      w = [0.0] * k
      for i, v in zip(free, sol):
        w[i] = v
      err = sum((sum(wj * xj for wj, xj in zip(w, x)) - y) ** 2 for x, y in zip(xs, ys))
      if err < best_err:
        best, best_err = w, err
  return [w / n for w, n in zip(best, norms)]


def gmean(xs: list[float]) -> float:
  return math.exp(sum(math.log(x) for x in xs) / len(xs))


def spearman_ceiling(times: list[float], sigma: float, draws: int = 2000, seed: int = 0) -> float:
  """The median Spearman correlation between `times` and the same times with log-normal noise
  `sigma`: what a perfect predictor reaches against one measurement that noisy. `times` are
  themselves measured, so their spread is a little overstated and so is the ceiling."""
  rng = random.Random(seed)
  rhos = sorted(
    spearman(times, [t * math.exp(rng.gauss(0.0, sigma)) for t in times]) for _ in range(draws)
  )
  return rhos[draws // 2]
