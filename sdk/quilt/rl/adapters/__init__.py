"""The ecosystems' environments through ``quilt.rl``, unchanged: each adapter wraps one
environment written for another framework as a :class:`quilt.rl.Env`, keeping that environment's
own reward code, and each ``*_group_builder`` makes a :data:`quilt.rl.GroupBuilder` that creates
those environments where they run (in process, or on an executor's workers: the builders pickle
what makes the environment, never the environment itself).

============================  ==============================  =====================================
framework                     adapter                         the environment speaks
============================  ==============================  =====================================
tinker-cookbook               :class:`CookbookEnv`            token ids (``tinker.ModelInput``)
verifiers (Environments Hub)  :class:`VerifiersEnv`           chat messages; its rubric scores
OpenEnv                       :class:`OpenEnvEnv`             typed actions and observations
SkyRL-Gym                     :class:`SkyRLGymEnv`            chat messages (``BaseTextEnv``)
Gymnasium                     :class:`GymnasiumTextEnv`       text observations and actions
============================  ==============================  =====================================

Text environments need a :class:`ChatCodec`: how a conversation becomes prompt token ids (the
tokenizer's chat template, or a plain layout) and sampled ids become text. Each turn's prompt is
the whole conversation so far, re-encoded.
"""

from ._text import ChatCodec, numeric
from .cookbook import CookbookEnv, cookbook_group_builder
from .gymnasium import GymnasiumTextEnv, gymnasium_group_builder
from .openenv import OpenEnvEnv, openenv_group_builder
from .skyrl import SkyRLGymEnv, skyrl_group_builder
from .verifiers import VerifiersEnv, verifiers_group_builder

__all__ = [
    "ChatCodec",
    "CookbookEnv",
    "GymnasiumTextEnv",
    "OpenEnvEnv",
    "SkyRLGymEnv",
    "VerifiersEnv",
    "cookbook_group_builder",
    "gymnasium_group_builder",
    "numeric",
    "openenv_group_builder",
    "skyrl_group_builder",
    "verifiers_group_builder",
]
