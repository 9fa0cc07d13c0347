"""The reference study: its arms, run on one seed group, and its markdown / JSON tables (`study`)."""
