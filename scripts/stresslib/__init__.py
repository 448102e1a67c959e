"""Stability checks of a running mmserver, run by ``scripts/chaos`` and ``scripts/soak``.

- :mod:`stresslib.proc` — the server under test as a child process on a free loopback port
  (started and stopped by :mod:`mmserver.commands.launch`), its process tree (frontend, fork
  server, resource tracker, backend processes) and its memory;
- :mod:`stresslib.load` — the load (the package's closed-loop users, bounded concurrency), and
  the probes that check each model's answers;
- :mod:`stresslib.chaos` — kills backend processes at random moments under load, then checks
  that the server recovered (``python -m stresslib.chaos``);
- :mod:`stresslib.soak` — a long mixed load over a store larger than the loaded-model budget,
  reported minute by minute (``python -m stresslib.soak``).

Everything talks to 127.0.0.1 only, every loop is bounded in count and time, and only processes
this code started (the server and its descendants) are ever signalled, by pid.
"""
