"""Fleet-wide metrics read from the database, and Prometheus' scrape configuration."""
