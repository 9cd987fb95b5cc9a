"""How much every method drafts: the one speculation policy.

`StepPolicy` (step_policy.py) is what the batch engine asks once a step (`plan(rows)`) and tells after the verify
forward (`observe`). Behind it, from the target's measured cost per forward size (models/step_costs.py) and the
acceptance each request shows (acceptance.py): the draft length, one choice per kind of drafting (draft_length.py),
the per-request gate of tree methods that run a model (draft_gate.py), and the measured-cost size of trees and
blocks (tree_budget.py), which the tree methods' proposers ask each step."""
