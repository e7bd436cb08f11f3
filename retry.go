package main

import (
	"context"
	"fmt"
	"time"

	"github.com/sirupsen/logrus"
)

// backoffDelay is the delay after the n-th failed attempt (n ≥ 1): base,
// 2·base, 4·base, … capped at max — for the connect phases 1s, 2s, 4s, 8s,
// 16s, 30s, 30s… by default; the outbox uses it for failed deliveries.
func backoffDelay(base, max time.Duration, n int) time.Duration {
	d := base
	for i := 1; i < n && d < max; i++ {
		d *= 2
	}
	return min(d, max)
}

// connectWithRetry calls connect until it succeeds or ctx ends. ctx is the
// phase's window (KUMIKO_CONNECT_MAX_WAIT, cut short by the boot budget or a
// shutdown request).
func (a *app) connectWithRetry(ctx context.Context, p *phaseRun, target component, connect func(context.Context) error) error {
	return a.retry(ctx, p, target, 0, connect)
}

// retry calls fn until it succeeds, ctx ends, or maxAttempts (0: no limit)
// have failed, backing off between attempts. Every failed attempt is logged
// with the delay before the next, and the final error names the attempts and
// the last error. target must be declared with connects, so that its
// kumiko_connect_attempts_total series exist from the start.
func (a *app) retry(ctx context.Context, p *phaseRun, target component, maxAttempts int, fn func(context.Context) error) error {
	start := time.Now()
	log := a.log.WithFields(logrus.Fields{"component": "lifecycle", "phase": p.name, "target": target.String()})
	for attempt := 1; ; attempt++ {
		actx, cancel := context.WithTimeout(ctx, a.timeouts.connectAttempt)
		var err error
		// The goroutines a client starts (a pool's, River's) are the target's,
		// started in the phase: they carry both names for life.
		labelled(withLabel(actx, labelPhase, p.name), labelComponent, target.String(), func() { err = fn(actx) })
		cancel()
		if err == nil {
			a.metrics.connectAttempts.WithLabelValues(target.String(), "ok").Inc()
			return nil
		}
		a.metrics.connectAttempts.WithLabelValues(target.String(), "failed").Inc()
		if attempt == maxAttempts {
			return fmt.Errorf("gave up on %s after %d attempts in %s: last error: %w",
				target, attempt, time.Since(start).Round(time.Millisecond), err)
		}

		delay := backoffDelay(a.cfg.Lifecycle.ConnectRetryBase, a.cfg.Lifecycle.ConnectRetryMax, attempt)
		log.WithFields(logrus.Fields{"attempt": attempt, "retry_in_ms": delay.Milliseconds()}).WithError(err).Warn("connect failed")
		select {
		case <-time.After(delay):
			p.retries++
		case <-ctx.Done():
			return fmt.Errorf("gave up on %s after %d attempts in %s: last error: %w",
				target, attempt, time.Since(start).Round(time.Millisecond), err)
		}
	}
}
