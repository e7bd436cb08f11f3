package main

import (
	"context"
	"fmt"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/riverqueue/river"
	"github.com/sirupsen/logrus"
)

// outboxRetentionFeature deletes delivered outbox events once they are older
// than the retention: on its cron (the leader's) or by hand.
func outboxRetentionFeature(cfg outboxConfig) feature {
	return feature{
		name: "outboxRetention",
		uses: []dependency{usesDB},
		workers: []worker{work(func(d workDeps, ctx context.Context, job *river.Job[purgeOutboxArgs]) error {
			return purgeOutbox(ctx, d, cfg.Retention)
		})},
		crons: []cronJob{schedule(cfg.PurgeCron, func(tick time.Time, token int64) purgeOutboxArgs {
			return purgeOutboxArgs{CronRun{ScheduledAt: tick, FencingToken: token}}
		})},
		manualJobs: []manualJob{byHand(func(echo.Context) (purgeOutboxArgs, error) {
			return purgeOutboxArgs{CronRun{ScheduledAt: time.Now().UTC(), Manual: true}}, nil
		})},
	}
}

// purgeOutboxArgs is one run of the outbox retention, on a cron tick or by hand.
type purgeOutboxArgs struct{ CronRun }

func (purgeOutboxArgs) Kind() string { return "purgeOutbox" }

// outboxPurgeBatch bounds one DELETE of the retention job: each batch is its
// own short transaction, so a large backlog never locks the table for long.
const outboxPurgeBatch = 1000

// purgeOutbox deletes delivered outbox events older than the retention, in
// batches. Pending events are never touched (delivered_at is null); dead
// events are kept too, for an operator to look at (and delete by hand).
func purgeOutbox(ctx context.Context, d workDeps, retention time.Duration) error {
	var deleted int64
	for {
		// Only delivered events have a delivery_seq, and its unique index
		// yields them oldest first: each batch reads a short prefix of it.
		tag, err := d.db.Exec(ctx, `DELETE FROM outbox_events WHERE id IN (
			SELECT id FROM outbox_events
			WHERE delivery_seq IS NOT NULL AND delivered_at < now() - make_interval(secs => $1) AND dead_at IS NULL
			ORDER BY delivery_seq LIMIT $2 FOR UPDATE SKIP LOCKED)`, retention.Seconds(), outboxPurgeBatch)
		if err != nil {
			return fmt.Errorf("deleting delivered outbox events older than %s (%d deleted so far): %w", retention, deleted, err)
		}
		deleted += tag.RowsAffected()
		if tag.RowsAffected() < outboxPurgeBatch {
			break
		}
	}
	d.log.WithFields(logrus.Fields{"job": purgeOutboxArgs{}.Kind(), "deleted": deleted, "retention": retention.String()}).Info("outbox purged")
	return nil
}
