"""Store sweeps: the stores' own PostgreSQL databases (`store_databases`), what start-up asks
them of the policies' statements (`store_checks`), deletion statements run there
(`store_targets`), and an HTTP list source's pages (`list_pages`).
"""
