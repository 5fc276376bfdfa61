"""Store sweeps: the stores' own PostgreSQL databases (`store_databases`), deletion statements run
there (`store_targets`), and an HTTP list source's pages (`list_pages`).
"""
