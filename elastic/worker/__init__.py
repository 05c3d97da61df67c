"""One EP rank: the worker process (decode loop, commands, rescale), its group generations, fault hooks, lifetime."""
