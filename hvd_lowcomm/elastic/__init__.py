"""Elastic DiLoCo groups: one MPI job (one failure domain) per group, a coordinator beside them,
and the rounds between groups run over process groups built for each membership, so a group
that fails costs one outer round, not the job (`python -m hvd_lowcomm.elastic`)."""

from __future__ import annotations

from typing import Any

from hvd_lowcomm.elastic.member import Member
from hvd_lowcomm.elastic.protocol import Launch


def member(position: int, comm: Any) -> Any:
    """This process's Member where the elastic launcher started it, else None."""
    launch = Launch.from_environment()
    if launch is None:
        return None
    return Member(launch, position, comm)
