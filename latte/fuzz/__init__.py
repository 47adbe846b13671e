"""Random differential testing: seeded random neurons and nets (:mod:`latte.fuzz.neurons`,
:mod:`latte.fuzz.nets`) checked across opt levels and against the reference interpreter
(:mod:`latte.fuzz.harness`). ``pytest tests/test_fuzz.py --fuzz N`` runs N cases."""
