"""Configuration of the commands: one source for every field's help, default and check.

base      the machinery: :class:`Option` (a field written once), :func:`option`, :class:`ConfigFile` (checks, YAML and
          dict round trips), :class:`Names` (deprecated and refused names), flags and the README reference
groups    the option groups: the fields several commands share (model, task/data, sampling, advantage, lens,
          optimizer, probing, runtime, output), each with its help, default and check
train     :class:`TrainConfig`, the settings of ``grpo-lens train``
demo      :class:`grpo_lens.config.demo.DemoConfig`, the settings of ``grpo-lens demo``

ProbeConfig (:mod:`grpo_lens.probe.config`) and DemoConfig are built from the same groups.
Load order: defaults <- YAML file (``--config``) <- command-line flags (``--group-size 8``); a bad value raises
:class:`ConfigError` naming the field and how to fix it, before any model loads.
"""

from grpo_lens.config.base import (
    Check,
    ConfigError,
    ConfigFile,
    ConfigNameWarning,
    Names,
    Option,
    above,
    add_config_arguments,
    at_least,
    config_from_args,
    flags_given,
    one_of,
    option,
    reference_markdown,
    require,
    yaml_error_line,
)
from grpo_lens.config.groups import DTYPES, GROUPS, check_task_dataset, resolve_device
from grpo_lens.config.train import TrainConfig

__all__ = [
    "Check",
    "ConfigError",
    "ConfigFile",
    "ConfigNameWarning",
    "DTYPES",
    "GROUPS",
    "Names",
    "Option",
    "TrainConfig",
    "above",
    "add_config_arguments",
    "at_least",
    "check_task_dataset",
    "config_from_args",
    "flags_given",
    "one_of",
    "option",
    "reference_markdown",
    "require",
    "resolve_device",
    "yaml_error_line",
]
