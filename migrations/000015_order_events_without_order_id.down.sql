-- Nothing to undo: the ids that were removed are not needed by any reader, and
-- writing them back would publish them again.
SELECT 1;
