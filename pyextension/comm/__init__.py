"""Collectives of zerofuse: the C++ Communicator (csrc/comm/). Bucketed gradient / parameter sync
on top of it is ZeRO's one bucket mechanism, zerofuse.zero.buckets. See DESIGN.md §3."""
from zerofuse.comm.communicator import CollectiveMismatch, Communicator, P2POp, Work, group_timeout, wait_seconds

__all__ = ["Communicator", "CollectiveMismatch", "P2POp", "Work", "group_timeout", "wait_seconds"]
