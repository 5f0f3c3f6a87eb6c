"""Studies: study files, running them on Ray Tune, results, reports (RLDP Sec. 3-4; ERRATA E7)."""

from raydp.study.config import StudyConfig, load_study
from raydp.study.grid import trial_config, trial_grid
from raydp.study.trial import Trial

__all__ = ["StudyConfig", "Trial", "load_study", "trial_config", "trial_grid"]
