"""How a measure grows with depth: the exponent p of v = c + a * L^p, fitted to the increments.

Chen et al.'s claim is about growth, not size: O(sqrt n) memory for n layers. A constant (the embedding, the LM
head, the batch) hides growth in the values themselves, so the fit uses the increments between consecutive depths,
where it cancels: v(L2) - v(L1) = a * (L2^p - L1^p). On log axes a line of slope p; gc off's activations grow as
L^1, Chen's schedule as L^0.5, Revolve's not at all. `gc.py sweep --over num_layers` prints and plots it.
"""
import math
import statistics

from .runsets import ordered_labels, run_label

__all__ = ["DEPTH_PARAMETERS", "fitted_exponent", "growth_exponents"]

DEPTH_PARAMETERS = ("num_layers", "seq_len")  # a chain's length: layers, or an LSTM's time steps


def fitted_exponent(xs, ys):
    """p of v = c + a * x^p through the points (least squares on the logs of the increments, p in [0, 3] to 0.001),
    or None where it cannot be fitted: fewer than 3 distinct x, or an increment that is not positive (a measure
    that does not grow has no exponent to show)."""
    points = sorted(dict(zip(xs, ys)).items())
    if len(points) < 3 or any(x <= 0 for x, _ in points):
        return None
    rises = [(x0, x1, v1 - v0) for (x0, v0), (x1, v1) in zip(points, points[1:])]
    if any(rise <= 0 for _, _, rise in rises):
        return None

    def misfit(p):  # the logs of the increments against log a + log(x1^p - x0^p), log a at its best
        gaps = [math.log(rise) - math.log(x1 ** p - x0 ** p) for x0, x1, rise in rises]
        mean = sum(gaps) / len(gaps)
        return sum((g - mean) ** 2 for g in gaps)
    return min((k / 1000 for k in range(1, 3001)), key=misfit)


def growth_exponents(records, over):
    """{policy label: {measure: the fitted exponent p of v = c + a * over^p (growth.py), or None}}, fitted to the
    medians over repeats."""
    measures = {"M_act": "activation_bytes", "M_peak": "peak_activation_bytes", "M_floor": "floor_bytes"}
    exponents = {}
    for label in ordered_labels(run_label(r) for r in records):
        mine = [r for r in records if run_label(r) == label]
        xs = sorted({r[over] for r in mine})
        exponents[label] = {}
        for name, key in measures.items():
            ys = [statistics.median(r[key] for r in mine if r[over] == x and r.get(key) is not None) for x in xs
                  if any(r[over] == x and r.get(key) is not None for r in mine)]
            exponents[label][name] = fitted_exponent(xs, ys) if len(ys) == len(xs) else None
    return exponents
