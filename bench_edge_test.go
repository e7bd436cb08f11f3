package main

// The rate limiter's cost, measured, not asserted:
//
//	KUMIKO_REQUIRE_SERVICES=1 go test -run '^$' -bench 'RateLimiter' -benchtime 2000x .
//
// BenchmarkRateLimiterReserve            the limiter's own cost per request (ns/op)
// demo:begin (the orders demo's benchmark, in orders_bench_test.go; scripts/new-service.sh --bare removes this block)
// BenchmarkRateLimiterCostOnCreateOrder  p50 of POST /api/orders with the limiter on and off
//                                        (two in-process instances, requests alternated)
// demo:end

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
