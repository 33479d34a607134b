"""The decode half: one pull (`pull`), the known peers (`peers`), the pull state machine (`side`), fail-closed
confirmation (`confirm`), releases (`releases`) and staging caches (`staging`). It never imports the prefill
half."""
