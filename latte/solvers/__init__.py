"""Solvers: SGD with momentum and weight decay, and the training loop ``solve``."""

from latte.solvers.policies import LRPolicy, MomPolicy
from latte.solvers.sgd import SGD, History, SolverParameters, solve

__all__ = ["History", "LRPolicy", "MomPolicy", "SGD", "SolverParameters", "solve"]
