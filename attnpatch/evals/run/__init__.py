"""Run plumbing shared by every eval: the report (:mod:`.report`: tables, JSON, interruption), resume from
kept results (:mod:`.resume`), data-parallel processes (:mod:`.distributed`), input devices
(:mod:`.devices`) and timing (:mod:`.timing`)."""
