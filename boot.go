package main

import (
	"context"
	"fmt"
	"time"
)

// defaultPhaseTimeout bounds phase 1, which runs before the configured
// KUMIKO_PHASE_TIMEOUT is known.
const defaultPhaseTimeout = 30 * time.Second

// boot runs the 16 startup phases in their fixed order. Each phase is one call
// to a function named after it, with its own timeout and failure policy, and
// logs one line when it ends. The first failure ends the boot; the caller then
// releases what was acquired, in reverse. ctx ends when a shutdown is requested,
// which aborts the boot at the phase it is in.
func (a *app) boot(ctx context.Context) error {
	// 1. config: defaults, overridden by kumiko.config.yaml, overridden by the environment; every problem at once.
	if err := a.lc.runPhase(ctx, "config", defaultPhaseTimeout, failExit, a.loadConfig); err != nil {
		return err
	}

	// The boot budget counts from process start, phase 1 included. Whichever
	// ends first, a phase's timeout or this budget, ends the boot.
	budget := a.cfg.Lifecycle.StartupTimeout
	ctx, cancel := context.WithDeadlineCause(ctx, a.born.Add(budget),
		fmt.Errorf("%w: not ready within KUMIKO_STARTUP_TIMEOUT=%s", errStartupBudget, budget))
	defer cancel()
	phase, connect := a.cfg.Lifecycle.PhaseTimeout, a.cfg.Lifecycle.ConnectMaxWait

	// 2. observability: logs, metrics, traces, and the ops listener, so probes answer during the boot.
	if err := a.lc.runPhase(ctx, "observability", phase, failExit, a.setupObservability); err != nil {
		return err
	}
	// 3. secrets: the master key.
	if err := a.lc.runPhase(ctx, "secrets", phase, failExit, a.loadMasterKey); err != nil {
		return err
	}
	// 4. runtimeChecks: Go version, GOMAXPROCS/GOMEMLIMIT vs cgroup, tzdata, fd limit.
	if err := a.lc.runPhase(ctx, "runtimeChecks", phase, failExit, a.checkRuntime); err != nil {
		return err
	}
	// 5. featureRegister: every feature declares its routes, events, jobs and crons.
	if err := a.lc.runPhase(ctx, "featureRegister", phase, failExit, a.registerAll); err != nil {
		return err
	}
	// 6. bootValidation: the feature graph, every problem at once, before anything connects.
	if err := a.lc.runPhase(ctx, "bootValidation", phase, failExit, a.validateBoot); err != nil {
		return err
	}
	// 7. dbConnect: the pool, retried with backoff for up to KUMIKO_CONNECT_MAX_WAIT.
	if err := a.lc.runPhase(ctx, "dbConnect", connect, failExit, a.connectDB); err != nil {
		return err
	}
	// 8. schemaBaseline: refuse a dirty or too-old schema (only when KUMIKO_SCHEMA_BASELINE is set).
	if err := a.lc.runPhase(ctx, "schemaBaseline", phase, failExit, a.checkSchemaBaseline); err != nil {
		return err
	}
	// 9. migrationsCheck: exit, apply or warn on pending migrations (KUMIKO_MIGRATIONS_MODE).
	if err := a.lc.runPhase(ctx, "migrationsCheck", phase, failExit, a.checkMigrations); err != nil {
		return err
	}
	// 10. redisConnect: the client, same backoff as the DB.
	if err := a.lc.runPhase(ctx, "redisConnect", connect, failExit, a.connectRedis); err != nil {
		return err
	}
	// 11. searchAdapter: Meilisearch; when down, warn and let search fall back.
	if err := a.lc.runPhase(ctx, "searchAdapter", phase, failWarn, a.connectSearch); err != nil {
		return err
	}
	// 12. fileStorage: the S3 bucket, created when missing; when down, warn and degrade.
	if err := a.lc.runPhase(ctx, "fileStorage", phase, failWarn, a.connectStorage); err != nil {
		return err
	}
	// 13. outboxPoller: start the poller (retried 3x).
	if err := a.lc.runPhase(ctx, "outboxPoller", phase, failExit, a.startOutboxPoller); err != nil {
		return err
	}
	// 14. jobsWorker: start the jobs worker, cron scheduler and leader election (retried 3x).
	if err := a.lc.runPhase(ctx, "jobsWorker", phase, failExit, a.startJobsWorker); err != nil {
		return err
	}
	// 15. apiListener: bind the API port; a port in use fails here, at once.
	if err := a.lc.runPhase(ctx, "apiListener", phase, failExit, a.listenAPI); err != nil {
		return err
	}
	// 16. ready: one real readiness probe; then state → ready and /health/ready answers 200.
	if err := a.lc.runPhase(ctx, "ready", phase, failExit, a.confirmReady); err != nil {
		return err
	}
	a.becomeReady()
	return nil
}
