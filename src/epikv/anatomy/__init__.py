"""Counterfactual importance labels, per-layer hidden-state profiles and band calibration (METHOD.md section 5).

- `labels`: occlusion labels over a trace's reasoning span (continuous NLL increase, or the authors' flip label).
- `profile`: g_l for every block, Spearman rho against the labels per layer, cluster-bootstrap intervals.
- `bands`: band A / band B chosen from a profile, written as a band file the policies read (`--bands-file`).
"""
