"""Collectives of zerofuse: the C++ Communicator (csrc/comm/) and bucketed gradient / parameter
sync on top of it. See DESIGN.md §3."""
from zerofuse.comm.buckets import Bucket, BucketGroup, BucketPlan
from zerofuse.comm.communicator import CollectiveMismatch, Communicator, Work, wait_seconds

__all__ = ["Communicator", "CollectiveMismatch", "Work", "wait_seconds", "BucketPlan", "Bucket", "BucketGroup"]
