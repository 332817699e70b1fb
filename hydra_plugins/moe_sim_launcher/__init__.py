"""moe-sim's Hydra launcher, ``hydra/launcher=inprocess`` (simulator/launcher.py).

Hydra instantiates plugins only from classes defined in the ``hydra_plugins`` namespace, which
it scans at start-up; this module names the launcher there and imports nothing heavy.
"""
import simulator.launcher


class InProcessLauncher(simulator.launcher.InProcessLauncher):
    """Every job of a multirun in this process, one decode per trace (simulator/launcher.py)."""
