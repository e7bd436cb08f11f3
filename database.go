package main

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
)

// dbConnect is phase 7: the pgx pool, retried with backoff. The pool's release
// and its readiness check are registered as soon as it answers.
func (a *app) dbConnect(ctx context.Context, p *phaseRun) error {
	poolCfg, err := pgxpool.ParseConfig(a.cfg.DatabaseURL)
	if err != nil {
		// A malformed URL will not heal with retries.
		return fmt.Errorf("parsing DATABASE_URL: %w", err)
	}
	poolCfg.ConnConfig.RuntimeParams["application_name"] = serviceName + "/" + a.cfg.InstanceID
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg) // lazy: connects on first use
	if err != nil {
		return fmt.Errorf("creating the pool: %w", err)
	}
	if err := a.connectWithRetry(ctx, p, "postgres", pool.Ping); err != nil {
		pool.Close()
		return err
	}
	a.db = pool
	// Close waits for acquired connections to be released, so in-flight
	// queries finish first; the hook's deadline bounds that wait.
	a.lc.RegisterShutdownHook("db", func(ctx context.Context) error {
		return runBounded(ctx, func() error { pool.Close(); return nil })
	})
	a.health.RegisterReadinessCheck("db", true, func(ctx context.Context) checkResult {
		return timedCheck(ctx, pool.Ping)
	})
	return nil
}
