"""``hydra/launcher=ray``: a sweep's jobs as Ray tasks (``gradmod.app.ray_jobs``). Ray itself
is imported only when a sweep launches, so Hydra's plugin scan works without the extra."""

from hydra.plugins.launcher import Launcher

from gradmod.app.ray_jobs import RayJobs


class RayLauncher(RayJobs, Launcher):
    pass
