//! The test harness's own guarantees: a Redis a test starts is its own,
//! even when the free port it picked is taken before the server binds it.
mod common;

use common::RedisServer;

#[test]
fn a_port_taken_by_another_redis_is_not_mistaken_for_ours() {
    let other = RedisServer::start();
    assert!(RedisServer::try_spawn(other.port, &[]).is_none());
}

#[test]
fn a_taken_port_is_left_for_a_free_one() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_port = taken.local_addr().unwrap().port();
    let mut picks = vec![common::free_port(), taken_port];
    let server = RedisServer::spawn_retrying(|| picks.pop().unwrap(), |_| Vec::new());
    assert_ne!(server.port, taken_port);
    let mut conn = server.client().get_connection().unwrap();
    let pong: String = redis::cmd("PING").query(&mut conn).unwrap();
    assert_eq!(pong, "PONG");
}
