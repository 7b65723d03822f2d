"""submitit's launchers (``hydra/launcher=submitit_local``, ``submitit_slurm``, ``slurm``),
each job's ending reported where submitit's process for it died."""

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher

from gradmod.app.launchers import SubmititEndings


class SubmititLocal(SubmititEndings, LocalLauncher):
    pass


class SubmititSlurm(SubmititEndings, SlurmLauncher):
    pass
