"""Verifier cost profile and the marginal-cost criterion (Uni-LaSpec, docs/algorithms.md section 2,
"Verifying what pays").

On a GPU at low load, verifying 16 tokens costs about what verifying 1 does;
on a 2-core CPU with torch's linear the cost jumps once the forward leaves the
small-matrix GEMM path (about 4 tokens) and then grows (with the small-batch
kernel of `ops.cpu_linear` it grows gently up to 24). A tree that is right on one device is
wrong on the other, so the size of what gets verified is chosen from a
MEASURED cost curve:

* `CostProfile`: T(n), seconds of one target forward over n new tokens
  (batch, dtype and device fixed), measured once on the real cache and kept
  in memory and on disk (`$HF_ADAPTIVE_SPEC_CACHE/_verifier_cost/`).
* `AcceptanceCalibrator`: maps the drafter's probability of a node to the
  chance the target accepts it given its parent was accepted, learned online
  from every verified node (the tree forward gives the target's choice after
  each node, on or off the accepted path).
* `choose_prefix`: the paper's rule "add nodes in decreasing survival
  probability pi_i while pi_i * t_token >= dT(n)", taken globally: with
  S(n) the summed pi of the n best nodes it keeps the n maximising
  S(n) - T(n + 1) / t_token over the batch. That is what the marginal rule
  aims at (long-run tokens per second, Dinkelbach form with t_token the
  current seconds per generated token); unlike the greedy local rule it does
  not stop at the first step of a non-convex curve (the CPU's jump at 4
  tokens followed by a flat stretch).

The parts: `profile` (the curve and its prior), `measure` (timed sweeps), `store` (memory, disk, environment,
correction by real rounds), `calibration` (learned acceptance), `selection` (which nodes to verify, pure maths),
`model` (`CostModel`, the drafting pauses) and `pricing` (`DraftPricing`).
"""

from .calibration import (ENV_COST_PROFILE, AcceptanceCalibrator, Calibration, LookupCalibrator, SpecCalibration,
                          verified_nodes)
from .measure import measure_verifier_cost
from .model import CostModel
from .pricing import DraftPricing
from .profile import DEFAULT_SIZES, WIDTH_SIZES_MAX, CostProfile, between, prior_profile
from .selection import choose_nodes, choose_prefix, choose_prefix_host, survival
from .store import measure_cost_curve, refine_profile, verifier_cost_profile

__all__ = ["AcceptanceCalibrator", "Calibration", "CostModel", "CostProfile", "DraftPricing", "LookupCalibrator",
           "choose_nodes", "choose_prefix",
           "measure_cost_curve", "measure_verifier_cost", "prior_profile", "refine_profile", "SpecCalibration",
           "verifier_cost_profile",
           "DEFAULT_SIZES", "ENV_COST_PROFILE", "WIDTH_SIZES_MAX", "between", "choose_prefix_host", "survival",
           "verified_nodes"]
