//! Byte-level fixtures of the mesh's HTTP head walk and framing
//! (bpf/include/inband/mesh/head.h), through BPF_PROG_TEST_RUN of
//! bpf/mesh_head_probe.bpf.c: the request and response programs cannot be
//! test-run themselves, and every byte they parse is the application's or
//! a backend's. Each case names what the programs then do with it.

use std::mem::MaybeUninit;

use inband_mesh::bpf::mesh_head_probe::{MeshHeadProbeSkel, MeshHeadProbeSkelBuilder};
use inband_core::shared::inband_mesh_head_result as HeadResult;
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, OpenObject, ProgramInput};

fn load(obj: &mut MaybeUninit<OpenObject>) -> MeshHeadProbeSkel<'_> {
    MeshHeadProbeSkelBuilder::default().open(obj).expect("open").load().expect("load mesh_head_probe.bpf.o")
}

fn parse(skel: &MeshHeadProbeSkel, msg: &[u8]) -> HeadResult {
    let mut frame = vec![0u8; 14];
    frame.extend_from_slice(msg);
    let out = skel
        .progs
        .mesh_head_probe
        .test_run(ProgramInput { data_in: Some(&frame), ..Default::default() })
        .expect("BPF_PROG_TEST_RUN");
    assert_eq!(out.return_value, 0, "probe failed on {:?}", String::from_utf8_lossy(msg));
    let bytes = skel.maps.mesh_head_result.lookup(&0u32.to_ne_bytes(), MapFlags::ANY).unwrap().unwrap();
    assert_eq!(bytes.len(), std::mem::size_of::<HeadResult>());
    // SAFETY: the map's value is this C struct (bindgen's layout tests check
    // it), made of integers only; the length is checked above.
    unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<HeadResult>()) }
}

#[test]
fn a_plain_request_head_is_split_into_its_lines() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    let msg = b"GET /a/b HTTP/1.1\r\nHost: svc\r\nContent-Length: 12\r\n\r\nbody follows";
    let r = parse(&skel, msg);
    assert_eq!(r.head_len as usize, msg.len() - 12);
    assert_eq!((r.sp1, r.sp2, r.first_end), (3, 8, 17));
    assert_eq!(r.n_lines, 2);
    assert_eq!(r.content_length, 12);
    assert_eq!((r.chunked, r.upgrade, r.not_keep_alive, r.bad, r.malformed), (0, 0, 0, 0, 0));
    // A response's status line: its first space is at 8 (the response program checks this).
    let r = parse(&skel, b"HTTP/1.1 204 No Content\r\n\r\n");
    assert_eq!((r.sp1, r.sp2, r.head_len, r.content_length), (8, 12, 27, -1));
}

#[test]
fn field_names_match_in_any_case_and_values_are_trimmed() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    let r = parse(&skel, b"GET / HTTP/1.1\r\nCONTENT-length: \t 7 \t\r\nconnection: Keep-Alive\r\n\r\n");
    assert_eq!(r.content_length, 7);
    assert_eq!((r.not_keep_alive, r.bad), (0, 0));
    // The same length twice is one length.
    let r = parse(&skel, b"POST / HTTP/1.1\r\nContent-Length: 3\r\ncontent-length: 3\r\n\r\nabc");
    assert_eq!((r.content_length, r.bad), (3, 0));
}

#[test]
fn what_sends_a_request_to_the_daemon_is_flagged() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    // fallback_chunked
    assert_eq!(parse(&skel, b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n").chunked, 1);
    // fallback_upgrade
    assert_eq!(parse(&skel, b"GET / HTTP/1.1\r\nUpgrade: websocket\r\n\r\n").upgrade, 1);
    assert_eq!(parse(&skel, b"POST / HTTP/1.1\r\nExpect: 100-continue\r\n\r\n").upgrade, 1);
    assert_eq!(parse(&skel, b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n").not_keep_alive, 1);
    // A longer name that starts like a known one is not that one.
    let r = parse(&skel, b"GET / HTTP/1.1\r\nContent-Lengthy: 5\r\nUpgraded: no\r\n\r\n");
    assert_eq!((r.content_length, r.upgrade, r.bad), (-1, 0, 0));
}

#[test]
fn smuggling_shapes_are_refused() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    // Two lengths that differ, a length that is not a number, one too long.
    for msg in [
        &b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab"[..],
        b"POST / HTTP/1.1\r\nContent-Length: 1a\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 1234567890123456\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length:\r\n\r\n",
        // No colon at all, an empty name.
        b"GET / HTTP/1.1\r\nHostsvc\r\n\r\n",
        b"GET / HTTP/1.1\r\n: empty name\r\n\r\n",
    ] {
        assert_eq!(parse(&skel, msg).bad, 1, "{:?}", String::from_utf8_lossy(msg));
    }
    // A control byte, a space or a high byte in a name (so white space
    // before the colon, RFC 9112 5.1), a bare LF.
    for msg in [
        &b"GET / HTTP/1.1\r\nContent-Length : 5\r\n\r\n"[..],
        b"GET / HTTP/1.1\r\nContent-Length\t: 5\r\n\r\n",
        b"GET / HTTP/1.1\r\nCont\x01ent-Length: 5\r\n\r\n",
        b"GET / HTTP/1.1\r\nContent Length: 5\r\n\r\n",
        b"GET / HTTP/1.1\r\nHo\xffst: x\r\n\r\n",
        b"GET / HTTP/1.1\nHost: x\n\n",
        b"GET / HTTP/1.1\r\nHost: x\n\r\n",
        b"GET / HTTP/1.1\r\nContent\rLength: 5\r\n\r\n",
    ] {
        let r = parse(&skel, msg);
        assert_eq!(r.malformed, 1, "{:?}", String::from_utf8_lossy(msg));
        assert_eq!(r.content_length, -1, "{:?}", String::from_utf8_lossy(msg));
    }
}

#[test]
fn heads_past_the_window_or_the_line_bound_go_to_user_space() {
    let mut obj = MaybeUninit::uninit();
    let skel = load(&mut obj);
    // No empty line yet: the head is not complete.
    let r = parse(&skel, b"GET / HTTP/1.1\r\nHost: x\r\n");
    assert_eq!((r.head_len, r.malformed, r.n_lines), (0, 0, 1));
    // 64 header lines fit, 65 do not.
    let lines = |n: usize| {
        let mut m = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..n {
            m.extend_from_slice(format!("X-{i}: v\r\n").as_bytes());
        }
        m.extend_from_slice(b"\r\n");
        m
    };
    let r = parse(&skel, &lines(64));
    assert_eq!((r.n_lines, r.malformed), (64, 0));
    assert_eq!(r.head_len as usize, lines(64).len());
    assert_eq!(parse(&skel, &lines(65)).malformed, 1);
    // A head that ends past 2,047 bytes is not found in the window.
    let mut long = b"GET / HTTP/1.1\r\nX-Big: ".to_vec();
    long.extend(std::iter::repeat(b'a').take(2100));
    long.extend_from_slice(b"\r\n\r\n");
    let r = parse(&skel, &long);
    assert_eq!((r.head_len, r.malformed), (0, 0));
    // One that ends just inside it is.
    let mut edge = b"GET / HTTP/1.1\r\nX-Big: ".to_vec();
    edge.extend(std::iter::repeat(b'a').take(2047 - edge.len() - 4));
    edge.extend_from_slice(b"\r\n\r\n");
    assert_eq!(edge.len(), 2047);
    assert_eq!(parse(&skel, &edge).head_len, 2047);
}
