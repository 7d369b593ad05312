"""The parts of a sweep and of one evaluation, by concern (the entry points are `pipelines/sweep.py` and
`pipelines/evaluate.py`):

    requests.py      the requests as a Ray Dataset of sealed blocks (built on the driver or in shards)
    engine.py        the evaluation engine: Ray Data over an autoscaling actor pool, failover, streaming
    checkpoints.py   a trial's answered blocks, saved as they come back (resume, retries)
    result.py        TrialResult: a trial's predictions, scores and metrics, one parquet file from trial to MLflow
    ray_connect.py   joining (or starting) Ray, the workers' runtime_env
    resources.py     GPU or CPU, pool sizes, trials at once, the autoscaler request, waiting for GPUs
    state.py         a sweep's saved state and --resume

The driver's MLflow logging of the trials and the console's summary are `pipelines/recording/`.
"""
