"""The ``captioner`` subcommands that need only the models package, gathered from their groups' modules.

The console script itself lives in :mod:`captioner.service.cli`, which adds ``serve`` on top of these, so that models/
never imports service/.
"""

from __future__ import annotations

import argparse

from . import data, evaluation, inference, training

#: the subcommands in the order `captioner --help` lists them, each with the module that defines it; the groups
#: interleave because the order is the one users know, older than the split into modules
ORDER = (
    (data, "data"),
    (training, "train"),
    (evaluation, "eval"),
    (training, "tune-decoding"),
    (training, "ensemble"),
    (evaluation, "resolution-check"),
    (evaluation, "compare"),
    (inference, "caption"),
    (inference, "export"),
    (evaluation, "card"),
    (evaluation, "plot"),
    (inference, "manifest"),
    (inference, "storage"),
    (evaluation, "params"),
    (evaluation, "zoo-table"),
    (evaluation, "zoo-f8k"),
    (evaluation, "grounding-doc"),
    (inference, "models"),
    (inference, "import"),
)


def add_commands(sub: argparse._SubParsersAction) -> None:
    for group, command in ORDER:
        group.register(sub, command)
