"""Collectives of zerofuse: the C++ Communicator (csrc/comm/) and bucketed gradient / parameter
sync on top of it. See DESIGN.md §3."""
from zerofuse.comm.buckets import Bucket, BucketGroup, BucketPlan
from zerofuse.comm.communicator import CollectiveMismatch, Communicator

__all__ = ["Communicator", "CollectiveMismatch", "BucketPlan", "Bucket", "BucketGroup"]
