"""A sweep's plugins and task directories reach Ray's workers through the runtime environment
(`pipelines.plugins.runtime_env`, in `worker_env`): a worker imports the shipped copy, and still finds both once the
driver's files are gone, as on a node that never had them."""
from __future__ import annotations

import shutil
import tempfile

import pytest
import ray

from pipelines import plugins
from pipelines.run.ray_connect import patient_start, worker_env

from tests.own_task import write_task

from .test_plugins import METHOD, isolated, write  # noqa: F401 - `isolated` is a fixture

pytestmark = pytest.mark.slow


@ray.remote(max_calls=1)  # every call in a fresh worker process: nothing imported before
def probe() -> dict:
    import sys

    import promprune
    from promprune.eval import tasks

    return {"method": "norm_ship" in promprune.methods(), "module": sys.modules["norm_ship"].__file__,
            "task_dirs": tasks.env_include_paths(), "task": "ship_task" in tasks.task_manager(["ship_task"]).all_tasks}


def test_plugins_and_task_directories_are_shipped_to_the_workers(tmp_path, isolated):  # noqa: F811
    driver = tmp_path / "driver"
    plugin = write(driver / "norm_ship.py", METHOD.format(name="norm_ship"))
    task_dir = driver / "shiptasks"
    write_task(task_dir, "ship_task")
    plugins.activate([str(plugin)], [str(task_dir)])
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    with patient_start():  # a busy machine's slow node registration is waited for
        ray.init(num_cpus=1, include_dashboard=False, runtime_env=worker_env(), _temp_dir=ray_dir)
    try:
        here = ray.get(probe.remote())
        assert here["method"] and here["task"]
        assert not here["module"].startswith(str(tmp_path)) and "py_modules" in here["module"]  # Ray's copy
        assert here["task_dirs"] == [str(task_dir)]  # the path itself while it is there
        shutil.move(str(driver), str(tmp_path / "gone"))  # the driver's files are not on this "node" any more
        away = ray.get(probe.remote())
        assert away["method"] and away["task"]
        assert away["task_dirs"][0].endswith("/shiptasks") and "py_modules" in away["task_dirs"][0]
    finally:
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
