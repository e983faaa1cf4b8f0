"""Exit statuses that mean something to herring_jax's launcher and to schedulers.

They live at the bottom of the package so that the launcher, which imports
neither jax nor the collectives, and the preemption agreement above the
collectives name one constant.
"""

# The exit status of a process, and of `herring-jax launch`, that stopped for a
# preemption after saving: neither success (the training is not done) nor
# failure (it resumes from its checkpoint). 75 is EX_TEMPFAIL of sysexits.h,
# "try again later"; a scheduler's retry loop restarts on it and stops on 0.
PREEMPTED_EXIT_CODE = 75
