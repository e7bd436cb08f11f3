package main

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// An Idempotency-Key's in-flight marker is a lease, not a lock with a long
// TTL: its holder renews it while the request runs, so a holder that dies
// (SIGKILL, OOM, a lost host) frees the key within idempotencyLease, and a
// retry then replays the stored order or runs. The marker only turns a
// concurrent duplicate into a 409 instead of a race; PostgreSQL's unique
// idempotency_key column is the truth, so a lease that lapses under a holder
// that still lives (a Redis that did not answer a renewal) costs nothing
// but that 409. The lease and its renewal are in timeouts.go.

// markerLease is an idempotency marker this request holds. Its value is the
// request's fingerprint and a random token: the fingerprint lets a
// concurrent request with another body be told 422 at once, the token makes
// renewal and release touch this request's marker only.
type markerLease struct {
	rdb     *redis.Client
	key     string
	value   string
	timeout time.Duration // one renewal or the release
	stop    chan struct{}
	done    chan struct{}
}

// claimMarker takes the marker key for a request with fingerprint hash and
// keeps renewing it until release. When another request holds it, the lease
// is nil and holderHash is that request's fingerprint. An error means Redis
// did not answer: the caller goes on without a marker.
func claimMarker(ctx context.Context, rdb *redis.Client, key, hash string, timeout time.Duration) (lease *markerLease, holderHash string, err error) {
	value := hash + " " + rand.Text()
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	// SET NX GET (Redis 7): take the key, or learn who holds it, in one step.
	held, err := rdb.SetArgs(cctx, key, value, redis.SetArgs{Mode: "NX", TTL: idempotencyLease, Get: true}).Result()
	switch {
	case errors.Is(err, redis.Nil):
	case err != nil:
		return nil, "", fmt.Errorf("claiming idempotency marker %s: %w", key, err)
	default:
		holderHash, _, _ = strings.Cut(held, " ")
		return nil, holderHash, nil
	}
	l := &markerLease{rdb: rdb, key: key, value: value, timeout: timeout, stop: make(chan struct{}), done: make(chan struct{})}
	go l.renew()
	return l, "", nil
}

// renew extends the lease while the request runs. A renewal that fails is
// tried again at the next tick; a lease that lapses meanwhile leaves the
// unique column to decide.
func (l *markerLease) renew() {
	defer close(l.done)
	tick := time.NewTicker(idempotencyRenewEvery)
	defer tick.Stop()
	for {
		select {
		case <-l.stop:
			return
		case <-tick.C:
			ctx, cancel := context.WithTimeout(context.Background(), l.timeout)
			renewScript.Run(ctx, l.rdb, []string{l.key}, l.value, idempotencyLease.Milliseconds())
			cancel()
		}
	}
}

// release stops the renewals, then deletes the marker if it is still this
// request's: a plain DEL would delete the marker of a second request that
// took the key after this one's lease lapsed.
func (l *markerLease) release(ctx context.Context) error {
	close(l.stop)
	<-l.done
	ctx, cancel := context.WithTimeout(ctx, l.timeout)
	defer cancel()
	if err := compareAndDelete.Run(ctx, l.rdb, []string{l.key}, l.value).Err(); err != nil {
		return fmt.Errorf("releasing idempotency marker %s: %w", l.key, err)
	}
	return nil
}
