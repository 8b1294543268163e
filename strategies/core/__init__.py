"""The machinery strategies share: the get_data_input contract (``contract``); the message of
the header family, by idea: what it carries (``parts``), its header's bytes (``header_format``),
packing (``packer``) and unpacking (``unpacker``); the speculative relay (``wire``) and its
plan (``relay_plan``); the base class of the header family (``packed``); plans (``plan``),
collective traces (``trace``), finishing a call whose leader failed part way (``completion``)
and the pure rank maths of a layout (``layout``). Nothing here is a strategy; the registry
skips it."""
