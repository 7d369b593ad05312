"""MLflow -> the paper's tables and figures. `pipelines/report.py` is the entry script; this package holds its parts:

- `store`: find a sweep (name, run id, or the latest) and load its trials and predictions from MLflow.
- `columns`: which metric stands for each benchmark in a table, and in what unit (the paper's).
- `tables`: the score table (Rel., best per budget in bold), the efficiency table, Table 4's matched split,
  the published numbers beside ours with deltas; markdown and CSV.
- `published`: the paper's numbers shipped under `pipelines/paper_results/`.
- `figures`: trade-off curves, the saliency-ratio sweep, the mu/tau heatmap, ablation bars, entropy histograms.
- `overlay`: kept tokens drawn on the image (saliency red, coverage cyan), as the paper's Fig. E1.
"""
