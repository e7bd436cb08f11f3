package main

// The rate limiter's cost on POST /api/orders, measured, not asserted:
//
//	KUMIKO_REQUIRE_SERVICES=1 go test -run '^$' -bench 'RateLimiter' -benchtime 2000x .
//
// BenchmarkRateLimiterCostOnCreateOrder  p50 of POST /api/orders with the limiter on and off
//                                        (two in-process instances, requests alternated)
// BenchmarkRateLimiterReserve            the limiter's own cost per request (ns/op)

import (
	"strconv"
	"testing"
	"time"
)

func BenchmarkRateLimiterReserve(b *testing.B) {
	l := newIPRateLimiter(1_000_000, 1_000_000, maxRateLimitedIPs)
	ips := make([]string, 1000)
	for i := range ips {
		ips[i] = "10.0." + strconv.Itoa(i/256) + "." + strconv.Itoa(i%256)
	}
	now := time.Now()
	b.ResetTimer()
	for n := range b.N {
		l.reserve(ips[n%len(ips)], now)
	}
}
