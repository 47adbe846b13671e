"""Solvers (SGD, Adam, AdamW, RMSProp, AdaGrad: compiled updates), their schedules, and
the training loop ``solve``."""

from latte.solvers.algorithms import SGD, AdaGrad, Adam, AdamW, RMSProp, Solver
from latte.solvers.policies import LRPolicy, MomPolicy
from latte.solvers.sgd import History, SolverParameters, solve

__all__ = ["AdaGrad", "Adam", "AdamW", "History", "LRPolicy", "MomPolicy", "RMSProp", "SGD",
           "Solver", "SolverParameters", "solve"]
