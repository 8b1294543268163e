"""The machinery strategies share: the get_data_input contract (``contract``), the binary
header and flat-buffer codec (``codec``), the speculative relay (``wire``), the base class of
the header family (``packed``), plans (``plan``), collective traces (``trace``), finishing a
call whose leader failed part way (``completion``) and the pure rank maths of a layout
(``layout``). Nothing here is a strategy; the registry skips it."""
