"""The machinery strategies share: the get_data_input contract (``contract``), the groups a
strategy receives (``process_groups``) and the base class that holds the contract
(``strategy_base``); the message of the header family, by idea: what it carries (``parts``),
its header's bytes (``header_format``), packing (``packer``) and unpacking (``unpacker``); the
speculative relay (``wire``) and its plan (``relay_plan``); the base class of the header
family (``packed``); the shared-memory node channel (``node_channel``) and its parts: its
messages (``node_signals``), its ring of segments (``segment_ring``), the writer's and a
reader's sides (``ring_writer``, ``ring_reader``) and the crossing of nodes
(``node_crossing``); plans (``plan``), collective traces (``trace``), finishing a call whose
leader failed part way (``completion``), the groups derived from megatron-core's
(``groups``), the pure rank maths of a layout (``layout``), a ROLL-shaped DataProto
(``roll_proto``), the leaves the peer reproductions refuse (``refusals``) and bounded memories
of recent shapes (``recent``); the α–β cost model ``auto`` chooses by: its form
(``formulas``), the machine room (``cluster``), the price of a plan (``pricing``), of its host
work (``host_work``) and the records a price fills (``costs``).
Nothing here is a strategy; the registry skips it."""
