"""Run plumbing shared by every eval: the report (:mod:`.report`: tables, JSON, interruption), resume from
kept results (:mod:`.resume`), data-parallel processes (:mod:`.distributed`) and input devices
(:mod:`.devices`); the timer they use is :mod:`attnpatch.timing`."""
