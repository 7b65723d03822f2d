"""submitit's launchers (``hydra/launcher=submitit_local``, ``submitit_slurm``, ``slurm``),
each job's ending reported where submitit's process for it died (``gradmod.app.launchers``)."""

from gradmod.app.launchers import SubmititEndings

try:  # hydra-submitit-launcher: the `sweeps` extra
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
except ImportError:  # not installed: gradmod registers none of these
    pass
else:

    class SubmititLocal(SubmititEndings, LocalLauncher):
        pass

    class SubmititSlurm(SubmititEndings, SlurmLauncher):
        pass
