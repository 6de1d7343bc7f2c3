"""Tools on top of the core: ``ampkit run`` (:mod:`.run`), the doctor
(:mod:`.diagnosis`), ``ampkit bench`` (:mod:`.bench`), the command line (:mod:`.cli`)
and the apex drop-in (:mod:`.compat`). They may import anything; nothing in the core
imports them."""
