"""The parts of a sweep and of one evaluation, by concern (the entry points are `pipelines/sweep.py` and
`pipelines/evaluate.py`):

    requests.py      the requests in Ray's object store as Arrow blocks (built on the driver or in shards)
    pool.py          the predictor actors and the pool a sweep shares among its trials
    result.py        TrialResult: a trial's predictions, scores and metrics, one parquet file from trial to MLflow
    ray_connect.py   joining (or starting) Ray, the workers' runtime_env
    resources.py     actors per trial and trials at once, from the cluster's GPUs
    state.py         a sweep's saved state and --resume
    recorder.py      the driver's MLflow logging of finished trials, the summary table
"""
