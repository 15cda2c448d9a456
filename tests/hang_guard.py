"""The subprocess timeout of the suite's runs: a guard against a hang, never a bound on speed.

Timeouts sized to an idle machine (300-900 s) failed runs that were only slow: under a load average of 5-11
on 2 cores, the DPO demo took 1334 s and hit its 900 s timeout in a fresh-clone CI run. A real hang still
ends the test, within CI's own limit.
"""

HANG_S = 3600
