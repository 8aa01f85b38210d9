"""The fleet control plane: servers announce themselves over MQTT, edges discover them, operators watch and drain.

Optional (the `mqtt` extra) and never on the token path: tokens always travel
over gRPC between one edge and one server; the broker only says which server
to use, how loaded it is, and when to move.
"""
