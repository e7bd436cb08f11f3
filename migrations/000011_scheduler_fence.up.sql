-- The fencing token of the newest scheduler leader. A leader enqueues a cron
-- tick only in a transaction that raises (or keeps) this token to its own, so
-- a stale leader — paused past its lock's TTL, then resumed — is refused by
-- the database even before the unique tick key would catch a duplicate.
CREATE TABLE scheduler_fence (
    id    boolean PRIMARY KEY DEFAULT true CHECK (id),
    token bigint  NOT NULL
);
INSERT INTO scheduler_fence (token) VALUES (0);
