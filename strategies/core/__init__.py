"""The machinery strategies share: the get_data_input contract (``contract``), the binary
header and flat-buffer codec (``codec``), the speculative relay (``wire``), the base class of
the header family (``packed``), plans (``plan``), collective traces (``trace``) and the pure
rank maths of a layout (``layout``). Nothing here is a strategy; the registry skips it."""
